//! Property tests of npukern live in `tests/` (see Cargo.toml for why this is
//! a separate workspace member); this library is empty.
