//! The bit fingerprint of an output: FNV-1a 64 over each element's bits.
//!
//! Shared, by path, with the root crate's `tests/bit_hashes.rs`, so the host
//! test and the embedded consumer hash the same way (no dependencies beyond
//! npukern's `Float`). Elements are widened to f32 first (exact for f16 and
//! bf16, so no information is lost) and hashed little-endian, which makes the
//! hash independent of the machine's byte order. A NaN hashes as the one
//! canonical quiet NaN: NaN-ness is reproducible, its payload and sign are
//! documented as not (IEEE leaves them open).

use npukern::Float;

/// A running FNV-1a 64 hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BitHash(pub u64);

impl Default for BitHash {
    fn default() -> Self {
        Self::new()
    }
}

impl BitHash {
    /// The FNV-1a offset basis.
    pub const fn new() -> Self {
        BitHash(0xcbf2_9ce4_8422_2325)
    }

    /// Mixes in raw bytes.
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        for &x in b {
            self.0 = (self.0 ^ x as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
        self
    }

    /// Mixes in a count or flag.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes(&v.to_le_bytes())
    }

    /// Mixes in every element's bits (NaN canonicalized).
    pub fn floats<T: Float>(&mut self, v: &[T]) -> &mut Self {
        for &x in v {
            let f = x.to_f32();
            let bits = if f.is_nan() { 0x7fc0_0000 } else { f.to_bits() };
            self.bytes(&bits.to_le_bytes());
        }
        self
    }

    /// The hash of `v` alone.
    pub fn of<T: Float>(v: &[T]) -> u64 {
        BitHash::new().floats(v).0
    }
}
