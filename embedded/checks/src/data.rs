//! Fixed-seed data and the tolerance arithmetic, without std (no `powf`,
//! no `sqrt`: values are built from bits).

use npukern::{DType, Float};

/// splitmix64: small, seeded, the same sequence on every target.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// A random sign, a 2^-10..2^10 binade and a random mantissa, rounded to T.
    pub fn mag<T: Float>(&mut self) -> T {
        let r = self.next_u64();
        let exp = 127 - 10 + (r >> 32) % 21;
        let bits = ((r & 1) << 31) as u32 | (exp as u32) << 23 | (r >> 9) as u32 & 0x7f_ffff;
        T::from_f32(f32::from_bits(bits))
    }

    /// A multiple of 1/8 in [-2, 2]: sums of a few stay exact in every dtype.
    pub fn eighth<T: Float>(&mut self) -> T {
        T::from_f32((self.below(33) as f32 - 16.0) / 8.0)
    }

    /// Fills `v` with `mag` values.
    pub fn fill<T: Float>(&mut self, v: &mut [T]) {
        v.iter_mut().for_each(|x| *x = self.mag());
    }
}

/// The spacing of T's values at |v| (one ulp), from the binade's exponent.
pub fn ulp(d: DType, v: f64) -> f64 {
    let (p, emin) = match d {
        DType::F16 => (11, -14),
        DType::BF16 => (8, -126),
        _ => (24, -126),
    };
    let e = ((v.to_bits() >> 52) & 0x7ff) as i64 - 1023;
    pow2(e.max(emin) - (p - 1))
}

/// 2^e for the exponents used here (normal f64 range).
pub fn pow2(e: i64) -> f64 {
    f64::from_bits(((e + 1023) as u64) << 52)
}

/// |a - b| <= tol, with NaN matching NaN and infinities matching exactly.
pub fn close(a: f64, b: f64, tol: f64) -> bool {
    if a.is_nan() || b.is_nan() {
        return a.is_nan() && b.is_nan();
    }
    a == b || (a - b).abs() <= tol
}

/// Bit equality with any NaN matching any NaN (payload and sign of a NaN are
/// not part of the contract).
pub fn same_bits<T: Float>(a: &[T], b: &[T]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            let (x, y) = (x.to_f32(), y.to_f32());
            (x.is_nan() && y.is_nan()) || x.to_bits() == y.to_bits()
        })
}
