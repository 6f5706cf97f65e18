//! Nothing to link: the benches are in `benches/` (`cargo bench -p npukern-benches`).
