//! Helpers shared by the criterion benches (`benches/`) and the quick ratio
//! table (`quick.rs`): `cargo bench -p npukern-benches`.

use npukern::Float;

/// `n` deterministic pseudo-random values in [-2, 2) (xorshift32), so every
/// bench and the quick table time the kernels on the same kind of data.
pub fn data<T: Float>(n: usize, seed: u32) -> Vec<T> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            T::from_f32((s % 2000) as f32 / 500.0 - 2.0)
        })
        .collect()
}
