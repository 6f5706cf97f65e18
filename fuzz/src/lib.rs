//! Shared helpers of the fuzz targets: a byte reader that turns the fuzzer's
//! input into choices and values (running out of bytes yields zeros, so every
//! input is a valid case), and the value tables that keep the interesting
//! floats (NaN, ±Inf, subnormals, ±65504, ...) and indices (extremes, near
//! the shard edges) frequent.

use half::{bf16, f16};

/// Consumes the fuzzer's bytes front to back.
pub struct Bytes<'a>(pub &'a [u8]);

impl Bytes<'_> {
    /// The next byte (0 once exhausted).
    pub fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&v, rest)) => {
                self.0 = rest;
                v
            }
            None => 0,
        }
    }

    /// Little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    /// Little-endian u32.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// Little-endian u64.
    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | u64::from(self.u32()) << 32
    }

    /// True with probability about `1/n` (n >= 1).
    pub fn one_in(&mut self, n: u8) -> bool {
        self.u8() % n == 0 && self.0.len() > 0
    }

    /// A value below `n` (n >= 1).
    pub fn below(&mut self, n: usize) -> usize {
        if n <= 256 {
            self.u8() as usize % n
        } else {
            self.u16() as usize % n
        }
    }

    /// One of `items`.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    /// A bool.
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// A float biased towards the values where kernels go wrong.
    pub fn f32(&mut self) -> f32 {
        const SPECIAL: [f32; 16] = [
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            1.0e-45, // smallest subnormal
            -3.0e-39,
            65504.0,
            -65504.0,
            f32::MAX,
            f32::MIN,
            1.0e-7,
            3.0e38,
        ];
        match self.u8() % 8 {
            0 => self.pick(&SPECIAL),
            // Ordinary magnitudes (1e-3 .. 1e3 with random mantissa and sign).
            1..=4 => {
                let m = (self.u16() as f32 / 65536.0 + 0.5) * if self.bool() { -1.0 } else { 1.0 };
                m * 10f32.powi(self.below(7) as i32 - 3)
            }
            // Any bit pattern (NaN payloads, subnormals, huge values).
            _ => f32::from_bits(self.u32()),
        }
    }

    /// An index biased towards the shard edges and the integer extremes.
    pub fn index(&mut self, num_weights: i64, vocab_start: i64) -> i64 {
        match self.u8() % 8 {
            0 => self.pick(&[i64::MIN, i64::MAX, i32::MIN as i64, i32::MAX as i64, -1, 0]),
            1 => vocab_start.wrapping_sub(1 + self.below(3) as i64),
            2 => vocab_start
                .wrapping_add(num_weights)
                .wrapping_add(self.below(3) as i64),
            3 => self.u64() as i64,
            _ => vocab_start.wrapping_add(self.below(num_weights.clamp(1, 65536) as usize) as i64),
        }
    }
}

/// An element type the fuzz targets fill from floats.
pub trait FromF32: Copy {
    /// Rounds (RNE) `v` to this type.
    fn from_f32(v: f32) -> Self;
}

impl FromF32 for f32 {
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl FromF32 for f16 {
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl FromF32 for bf16 {
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// `n` values from `b` (a run of one value now and then, for hot rows and
/// equal elements).
pub fn values<T: FromF32>(b: &mut Bytes<'_>, n: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        let x = T::from_f32(b.f32());
        let run = if b.one_in(8) { 1 + b.below(64) } else { 1 };
        for _ in 0..run.min(n - v.len()) {
            v.push(x);
        }
    }
    v
}

/// Dims of rank `rank` whose product is at most `cap` (0-length dims now and
/// then). Each dim is drawn from a table that includes 1, the lane width's
/// neighbours and odd lengths.
pub fn dims(b: &mut Bytes<'_>, rank: usize, cap: usize) -> Vec<usize> {
    const D: [usize; 16] = [1, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 33, 64, 100, 257];
    let mut out = Vec::with_capacity(rank);
    let mut prod = 1usize;
    for _ in 0..rank {
        let d = match b.u8() % 16 {
            0 => 0,
            1 => b.below(cap + 1),
            k => D[k as usize % D.len()],
        };
        let d = if prod.saturating_mul(d) > cap {
            cap / prod.max(1)
        } else {
            d
        };
        prod = prod.saturating_mul(d).max(1);
        out.push(d);
    }
    out
}
