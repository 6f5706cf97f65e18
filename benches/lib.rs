//! Helpers shared by the criterion benches (`benches/`) and the quick ratio
//! table (`quick.rs`): `cargo bench -p npukern-benches`.

use std::ops::{Deref, DerefMut};

use npukern::Float;

/// A buffer whose first element is 64-byte aligned, as PyTorch's CPU
/// allocator (and any cache-line-aware allocator) hands them out: timings
/// must not depend on where the global allocator happened to place a Vec.
pub struct Aligned<T> {
    buf: Vec<T>,
    off: usize,
    len: usize,
}

impl<T: Copy> Aligned<T> {
    /// `len` copies of `v`.
    pub fn filled(v: T, len: usize) -> Self {
        let pad = 64 / core::mem::size_of::<T>().max(1);
        let buf = vec![v; len + pad];
        let mis = buf.as_ptr() as usize % 64;
        let off = if mis == 0 {
            0
        } else {
            (64 - mis) / core::mem::size_of::<T>().max(1)
        };
        Aligned { buf, off, len }
    }

    /// The values of `it` (exactly `len` of them).
    pub fn from_iter(len: usize, it: impl IntoIterator<Item = T>) -> Option<Self> {
        let mut it = it.into_iter();
        let first = it.next()?;
        let mut a = Self::filled(first, len);
        for (d, v) in a.iter_mut().skip(1).zip(it) {
            *d = v;
        }
        Some(a)
    }
}

impl<T> Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.off..self.off + self.len]
    }
}

impl<T> DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.off..self.off + self.len]
    }
}

/// `n` deterministic pseudo-random values in [-2, 2) (xorshift32), 64-byte
/// aligned, so every bench and the quick table time the kernels on the same
/// kind of data.
pub fn data<T: Float>(n: usize, seed: u32) -> Aligned<T> {
    let mut s = seed.wrapping_mul(2_654_435_761).max(1);
    let mut a = Aligned::filled(T::from_f32(0.0), n);
    for d in a.iter_mut() {
        s ^= s << 13;
        s ^= s >> 17;
        s ^= s << 5;
        *d = T::from_f32((s % 2000) as f32 / 500.0 - 2.0);
    }
    a
}

/// `n` zeros, 64-byte aligned.
pub fn zeros<T: Float>(n: usize) -> Aligned<T> {
    Aligned::filled(T::from_f32(0.0), n)
}
