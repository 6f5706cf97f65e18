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
        self.u8().is_multiple_of(n) && !self.0.is_empty()
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

/// Dims of rank `rank` whose product is at most `cap`, also with any 0 dim
/// read as 1 (0-length dims now and then). Each dim is drawn from a table that includes 1, the lane width's
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
        // A 0 counts as 1: a target that turns a 0 into 1 (`|= 1`) keeps
        // the bound (a product reset after a 0 made a 15M-element geglu
        // case, 19 s in the coverage build).
        prod = prod.saturating_mul(d.max(1));
        out.push(d);
    }
    out
}

/// Values of ordinary magnitude (1e-2 .. 15, random signs, zeros now and
/// then; products of three stay inside f16's range): the inputs on which
/// results are compared with the f64 reference within the documented
/// tolerances.
pub fn tame_values<T: npukern::Float>(b: &mut Bytes<'_>, n: usize) -> Vec<T> {
    (0..n)
        .map(|_| {
            if b.one_in(16) {
                return T::from_f32(0.0);
            }
            let m = (b.u16() as f32 / 65536.0 + 0.5) * if b.bool() { -1.0 } else { 1.0 };
            T::from_f32(m * 10f32.powi(b.below(4) as i32 - 2))
        })
        .collect()
}

/// `n` values, tame or not (`tame` picks).
pub fn some_values<T: npukern::Float>(b: &mut Bytes<'_>, n: usize, tame: bool) -> Vec<T> {
    if tame {
        tame_values(b, n)
    } else {
        let v: Vec<f32> = values(b, n);
        v.into_iter().map(T::from_f32).collect()
    }
}

/// Every ISA this build and CPU run.
pub fn isas() -> Vec<npukern::Isa> {
    npukern::Isa::ALL
        .into_iter()
        .filter(|i| i.is_available())
        .collect()
}

/// Bit-identical, except that any NaN matches any NaN (payload and sign of
/// a NaN are not part of the promise).
pub fn same_bits<T: npukern::Float>(a: &[T], b: &[T]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(0);
    }
    (0..a.len()).find(|&i| {
        let (x, y) = (a[i].to_f32(), b[i].to_f32());
        !(x.is_nan() && y.is_nan()) && x.to_bits() != y.to_bits()
    })
}

/// Asserts `same_bits`, naming the first difference.
#[track_caller]
pub fn assert_same<T: npukern::Float>(a: &[T], b: &[T], what: &str) {
    if let Some(i) = same_bits(a, b) {
        panic!(
            "{what}: differs at {i} of {}: {:e} vs {:e}",
            a.len(),
            a.get(i).map_or(f32::NAN, |v| v.to_f32()),
            b.get(i).map_or(f32::NAN, |v| v.to_f32())
        );
    }
}

/// Distance in units in the last place between two values of one dtype
/// (0 for two NaNs; large when exactly one is NaN).
pub fn ulps<T: npukern::Float>(a: T, b: T) -> u64 {
    let (x, y) = (a.to_f64(), b.to_f64());
    if x.is_nan() || y.is_nan() {
        return if x.is_nan() && y.is_nan() {
            0
        } else {
            u64::MAX
        };
    }
    // Ordered integer images of the bit patterns (sign-magnitude -> two's).
    let ord = |v: T| -> i64 {
        let bits: u64 = match core::mem::size_of::<T>() {
            4 => bytemuck::cast::<T, u32>(v) as u64,
            _ => bytemuck::cast::<T, u16>(v) as u64,
        };
        let sign = 1u64 << (core::mem::size_of::<T>() * 8 - 1);
        if bits & sign != 0 {
            -((bits & !sign) as i64)
        } else {
            bits as i64
        }
    };
    ord(a).abs_diff(ord(b))
}

/// One unit in the last place of `T` at magnitude `v` (the gap above `v`
/// rounded to `T`).
pub fn ulp_at<T: npukern::Float>(v: f64) -> f64 {
    let t = T::from_f64(v.abs());
    let next: T = match core::mem::size_of::<T>() {
        4 => bytemuck::cast::<u32, T>(bytemuck::cast::<T, u32>(t) + 1),
        _ => bytemuck::cast::<u16, T>(bytemuck::cast::<T, u16>(t) + 1),
    };
    (next.to_f64() - t.to_f64()).abs()
}

std::thread_local!(static CAPPED: core::cell::Cell<bool> = const { core::cell::Cell::new(false) });

/// A workspace of `bytes`, or none at all when that is more than the fuzzer
/// should allocate (64 MiB: a huge num_weights or tiling asks for more); the
/// call must then fail (workspace too small), and `capped` says so.
pub fn workspace(bytes: usize) -> Vec<u8> {
    if bytes > 64 << 20 {
        CAPPED.with(|c| c.set(true));
        Vec::new()
    } else {
        vec![0u8; bytes]
    }
}

/// True when `workspace` declined an allocation since the last call.
pub fn capped() -> bool {
    CAPPED.with(|c| c.replace(false))
}

/// Two runs' results agree: equal, or one of them failed only because
/// `workspace` declined its allocation (`a_capped` / `b_capped`).
pub fn same_outcome(
    a: &npukern::Result<()>,
    a_capped: bool,
    b: &npukern::Result<()>,
    b_capped: bool,
) -> bool {
    use npukern::Error::WorkspaceTooSmall;
    let declined =
        |r: &npukern::Result<()>, c: bool| c && matches!(r, Err(WorkspaceTooSmall { .. }));
    a == b || declined(a, a_capped) || declined(b, b_capped)
}
