//! The explicit SIMD layer.
//!
//! A `Lanes` value is sixteen f32 lanes. Sixteen is the width of the
//! reduction pattern every row sum uses (element `j` goes to lane `j % 16`),
//! so every ISA presents the same logical width and composes it from its own
//! registers (two `f32x8` for the portable `wide` lanes, one zmm for AVX-512).
//! Kernel bodies are written once, generic over `Lanes`, and instantiated per
//! ISA; nothing here uses FMA, so every ISA produces the same bits.

use core::mem::MaybeUninit;

use half::{bf16, f16};

use crate::dtype::Float;

pub mod detect;
mod fp_env;
#[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
pub mod neon;
pub mod portable;
pub mod random;
pub mod stream;
#[cfg(target_arch = "x86_64")]
pub mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_bf16;

pub use detect::Isa;
pub(crate) use fp_env::with_default_modes;
#[cfg(target_arch = "x86_64")]
pub(crate) use fp_env::with_flush_to_zero;
#[cfg(all(target_arch = "aarch64", target_feature = "neon"))]
pub use neon::{Neon, NeonBf16};
pub use portable::Portable;
#[cfg(target_arch = "x86_64")]
pub use x86::{Avx2, Avx512, Avx512Bf16};

/// The ISA list, best last: `Variant = npk_isa value, "name", lanes type
/// (re-exported above), cfg under which it is built;`. Everything that names
/// ISAs — `Isa`, its names and order, detection, `dispatch_isa!` — is
/// generated from it: adding an ISA is its lanes file and one line here
/// (docs/adding-an-isa.md). Invoked as `isa_list!([path::to::callback]
/// (args))`, which expands to `path::to::callback! { (args) <the list> }`.
macro_rules! isa_list {
    ([$($cb:tt)*] ($($a:tt)*)) => {
        $($cb)*! { ($($a)*)
            /// `wide` lanes: SSE2 on x86_64, NEON on aarch64 (16-bit
            /// conversions element by element), scalar elsewhere.
            Portable = 1, "portable", Portable, all();
            /// AVX2 + FMA + F16C (x86_64); FMA is enabled but never used.
            Avx2 = 2, "avx2", Avx2, target_arch = "x86_64";
            /// AVX-512F and BW (with AVX2, FMA, F16C) on x86_64.
            Avx512 = 3, "avx512", Avx512, target_arch = "x86_64";
            /// `Avx512` with AVX512-BF16 (and DQ, VL): bf16 rounding in
            /// hardware (Zen 4, Sapphire Rapids and later), the same bits.
            Avx512Bf16 = 4, "avx512bf16", Avx512Bf16, target_arch = "x86_64";
            /// AArch64 Advanced SIMD (baseline on every AArch64 CPU).
            Neon = 5, "neon", Neon, all(target_arch = "aarch64", target_feature = "neon");
            /// `Neon` with FEAT_BF16's `BFCVTN` for the bf16 rounding
            /// (Neoverse V1/N2, Graviton 3 and later), the same bits.
            NeonBf16 = 6, "neonbf16", NeonBf16, all(target_arch = "aarch64", target_feature = "neon");
        }
    };
}
pub(crate) use isa_list;

/// Calls `$body` with `$L` bound to the Lanes type of `$isa`, a
/// `detect::Available` (so present on this CPU). Kernel bodies must run
/// their per-block work inside `L::enter`.
macro_rules! dispatch_isa {
    ($isa:expr, $L:ident => $body:expr) => {
        $crate::lanes::isa_list!([$crate::lanes::dispatch_isa_arms]($isa, $L, $body))
    };
}
pub(crate) use dispatch_isa;

/// `dispatch_isa!`'s match, one arm per ISA built on this target.
macro_rules! dispatch_isa_arms {
    (($isa:expr, $L:ident, $body:expr) $($(#[$doc:meta])* $v:ident = $raw:literal, $name:literal, $t:ident, $cfg:meta;)*) => {{
        let available: $crate::lanes::detect::Available = $isa;
        #[allow(unreachable_patterns)]
        match available.isa() {
            $(
                #[cfg($cfg)]
                $crate::lanes::Isa::$v => {
                    type $L = $crate::lanes::$t;
                    $body
                }
            )*
            // ISAs not built for this target are never resolved as available.
            _ => {
                type $L = $crate::lanes::Portable;
                $body
            }
        }
    }};
}
pub(crate) use dispatch_isa_arms;

/// Runs `f` entered for `L` (`Lanes::enter`) as a function of its own,
/// never inlined into the caller. For kernels with many loop forms: LLVM's
/// loop passes cost about the square of a function's size, and a block
/// function with every form inlined took minutes per ISA and dtype to
/// build. A call per row costs nothing next to the row. Pass `f` as an
/// `#[inline(always)]` closure (else LLVM may leave it outside the ISA's
/// context, every lane operation a call), and copy what it reads through
/// a reference to a local inside it (`&{ *k }`): behind the caller's
/// pointer the fields are reloaded after each store through a raw output
/// pointer.
///
/// # Safety
/// As `Lanes::enter`: the CPU must support `L::ISA`.
#[inline(never)]
pub(crate) unsafe fn enter_apart<L: Lanes, R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: the caller's contract.
    unsafe { L::enter(f) }
}

/// `enter_apart` with `Lanes::enter_flushing`.
///
/// # Safety
/// As `Lanes::enter`: the CPU must support `L::ISA`.
#[inline(never)]
pub(crate) unsafe fn enter_apart_flushing<L: Lanes, R>(f: impl FnOnce() -> R) -> R {
    // SAFETY: the caller's contract.
    unsafe { L::enter_flushing(f) }
}

/// The logical vector width and the reduction pattern's lane count.
pub const GROUP: usize = 16;

/// Groups summed sequentially into one partial before partials are combined
/// pairwise: 128 groups = 2048 elements. Keeps long-row sums accurate (rstd
/// within 1e-6 on 110000-element rows) without depending on anything but N.
pub const SEGMENT_GROUPS: usize = 128;

/// Sixteen f32 lanes with IEEE arithmetic (no FMA, no approximations).
pub trait Lanes: Copy + Send + Sync + 'static {
    /// Which ISA this is.
    const ISA: Isa;
    /// Whether `stream` is a non-temporal store (x86's vector lanes). Where
    /// it is an ordinary store (NEON, the portable lanes), `run_blocks!`
    /// instantiates a kernel only in its ordinary-store form: the streamed
    /// form would compile the same stores twice (the same bits either way).
    const STREAMS: bool = false;
    /// Whether this CPU (and OS) can run these lanes, uncached (`Isa`'s
    /// detection caches it). Only after it said yes may `enter` run.
    fn detect() -> bool;
    /// Runs `f` inside this ISA's `#[target_feature]` context, so the lane
    /// operations of a kernel body instantiated for `Self` inline as vector
    /// instructions. Kernels call it once per block.
    ///
    /// # Safety
    /// The CPU must support `Self::ISA` (`detect::available`).
    unsafe fn enter<R>(f: impl FnOnce() -> R) -> R;
    /// Whether `enter_flushing` runs `f` under x86's FTZ and DAZ, so that
    /// `mul_add` is one step of VDPBF16PS (subnormal operands read as zero,
    /// results tiny after rounding flushed): the hardware FMA lanes of x86.
    /// (The portable lanes' FMA is software; AArch64's FZ detects tininess
    /// before rounding.)
    const FLUSHING_FMA: bool = false;
    /// `enter`, with flush-to-zero and denormals-are-zero on where
    /// `FLUSHING_FMA` (else `enter` itself).
    ///
    /// # Safety
    /// As `enter`.
    #[inline(always)]
    unsafe fn enter_flushing<R>(f: impl FnOnce() -> R) -> R {
        // SAFETY: the caller's.
        unsafe { Self::enter(f) }
    }
    /// All lanes `x`.
    fn splat(x: f32) -> Self;
    /// Loads sixteen f32.
    fn load(src: &[f32; GROUP]) -> Self;
    /// Stores sixteen f32.
    fn store(self, dst: &mut [f32; GROUP]);
    /// Loads sixteen bf16, widened exactly.
    fn load_bf16(src: &[bf16; GROUP]) -> Self;
    /// Stores sixteen bf16, rounded to nearest even (NaN kept, overflow to Inf).
    fn store_bf16(self, dst: &mut [bf16; GROUP]);
    /// Loads sixteen f16, widened exactly.
    fn load_f16(src: &[f16; GROUP]) -> Self;
    /// Every lane rounded to bf16 (as `store_bf16`) and widened back, in
    /// registers where the ISA can.
    #[inline(always)]
    fn round_bf16(self) -> Self {
        let mut t = [bf16::ZERO; GROUP];
        self.store_bf16(&mut t);
        Self::load_bf16(&t)
    }
    /// Every lane rounded to f16 (as `store_f16`) and widened back.
    #[inline(always)]
    fn round_f16(self) -> Self {
        let mut t = [f16::ZERO; GROUP];
        self.store_f16(&mut t);
        Self::load_f16(&t)
    }
    /// Stores sixteen f16, rounded to nearest even (NaN kept, overflow to Inf).
    fn store_f16(self, dst: &mut [f16; GROUP]);
    /// `random::mix32((lo + j) ^ k)` for j in 0..16 (`lo + 15` must not
    /// wrap): sixteen consecutive keys' random bits.
    #[inline(always)]
    fn hash16(lo: u32, k: u32) -> [u32; GROUP] {
        let mut r = [0u32; GROUP];
        for (j, x) in r.iter_mut().enumerate() {
            *x = random::mix32((lo + j as u32) ^ k);
        }
        r
    }
    /// Stores sixteen bf16 rounded stochastically
    /// (`random::round_bf16_sr` with the bits `(r[j] >> SHIFT) & 0xffff`).
    #[inline(always)]
    fn store_bf16_sr<const SHIFT: u32>(self, dst: &mut [bf16; GROUP], r: &[u32; GROUP]) {
        let mut f = [0f32; GROUP];
        self.store(&mut f);
        for j in 0..GROUP {
            dst[j] = bf16::from_bits(random::round_bf16_sr(f[j], r[j] >> SHIFT));
        }
    }
    /// The 16 x 16 transpose: lane `i` of `out[j]` is lane `j` of
    /// `rows[i]` (moves only: no bit changes). A packing loop transposes
    /// through it instead of strided scalar moves.
    #[inline(always)]
    fn transpose16(rows: &[Self; GROUP]) -> [Self; GROUP] {
        let mut m = [[0f32; GROUP]; GROUP];
        for (r, v) in m.iter_mut().zip(rows) {
            v.store(r);
        }
        core::array::from_fn(|j| Self::load(&core::array::from_fn(|i| m[i][j])))
    }
    /// `store` with a non-temporal (streaming) store when `dst` is aligned
    /// for it, else an ordinary one: the same bits either way. Streaming
    /// stores skip the destination's read-for-ownership and do not displace
    /// cached data; a kernel issues `stream_fence` after its last one.
    fn stream(self, dst: &mut [f32; GROUP]);
    /// `self` then `hi` as 32 bf16 (one 64-byte line), converted and stored
    /// as one line where the ISA can; with `STREAM`, streamed when `dst` is
    /// 64-byte aligned. Only whole lines are streamed: a partly written
    /// write-combining line goes to memory as slow partial writes. The
    /// default stores the two halves (lanes without streaming stores).
    #[inline(always)]
    fn put2_bf16<const STREAM: bool>(self, hi: Self, dst: &mut [bf16; 2 * GROUP]) {
        let (a, b) = dst.split_at_mut(GROUP);
        if let (Ok(a), Ok(b)) = (a.try_into(), b.try_into()) {
            self.store_bf16(a);
            hi.store_bf16(b);
        }
    }
    /// `put2_bf16` for f16.
    #[inline(always)]
    fn put2_f16<const STREAM: bool>(self, hi: Self, dst: &mut [f16; 2 * GROUP]) {
        let (a, b) = dst.split_at_mut(GROUP);
        if let (Ok(a), Ok(b)) = (a.try_into(), b.try_into()) {
            self.store_f16(a);
            hi.store_f16(b);
        }
    }
    /// Whether `load_line_bf16` and `put_line_bf16` keep a line's elements
    /// in order (`lo` = elements 0..16, `hi` = 16..32). AVX-512 does not:
    /// its line order is the even elements then the odd ones.
    const BF16_LINE_IN_ORDER: bool = true;
    /// Whether kernels take their software-pipelined loop forms here (the
    /// fused CrossEntropy's next-row max and in-loop pass 2): they pay on
    /// wide out-of-order cores and cost code size (one more loop instance
    /// per form, dtype and option). The portable lanes serve small in-order
    /// cores (Cortex-M, whose code memory the pipelined forms overflowed)
    /// and checking: one loop form there. The same operations either way:
    /// the same bits.
    const PIPELINED: bool = true;
    /// Whether the heavy lane functions (`math`'s `exp_scale`, `tanh`,
    /// `erf`, `log`) and the 16-bit conversions are called, not inlined
    /// into every loop body. Inlined, they are a few vector instructions on
    /// the SIMD lanes; on the portable lanes every lane is scalar code on
    /// targets without SIMD, and inlining them everywhere made the library
    /// 4.4 MB of code on thumbv7em (the Cortex-M4F checks no longer fit
    /// in its 4 MiB of code memory) and its optimized build CI's longest. A
    /// call per 16 lanes costs little beside 16 scalar `erf`s; the same
    /// operations either way: the same bits.
    const OUTLINED: bool = false;
    /// One line of 32 bf16 widened exactly into two vectors in this ISA's
    /// *line order* (`BF16_LINE_IN_ORDER`). AVX-512's even/odd order widens
    /// a whole line with one shift and one mask, where in-order lanes take a
    /// word-to-dword permute per group. Only elementwise code may use it, with
    /// every operand in the same order (a row sum's lanes are fixed).
    #[inline(always)]
    fn load_line_bf16(src: &[bf16; 2 * GROUP]) -> (Self, Self) {
        let (g, _) = src.as_chunks::<GROUP>();
        (Self::load_bf16(&g[0]), Self::load_bf16(&g[1]))
    }
    /// The inverse of `load_line_bf16`: `lo`, `hi` in line order rounded as
    /// `store_bf16` and stored as one line; with `STREAM`, streamed as
    /// `put2_bf16` does. Every output bit is that of `store_bf16`.
    #[inline(always)]
    fn put_line_bf16<const STREAM: bool>(lo: Self, hi: Self, dst: &mut [bf16; 2 * GROUP]) {
        lo.put2_bf16::<STREAM>(hi, dst)
    }
    /// `lo`, `hi` in line order rounded to bf16: stored as `put_line_bf16`
    /// stores them when `dst` is given, and returned widened (each the
    /// value `round_bf16` gives), so one conversion serves a rounded side
    /// output and the arithmetic that goes on with the rounded values.
    #[inline(always)]
    fn round_line_bf16<const STREAM: bool>(
        lo: Self,
        hi: Self,
        dst: Option<&mut [bf16; 2 * GROUP]>,
    ) -> (Self, Self) {
        if let Some(d) = dst {
            Self::put_line_bf16::<STREAM>(lo, hi, d);
        }
        (lo.round_bf16(), hi.round_bf16())
    }
    /// Orders this thread's streaming stores before its later stores
    /// (`sfence` on x86_64), so a block's outputs are complete when it
    /// returns.
    #[inline(always)]
    fn stream_fence() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: sfence is SSE (baseline on x86_64).
        unsafe {
            core::arch::x86_64::_mm_sfence()
        };
    }
    /// Hints that the cache line at `p` will be read soon, fetching it into
    /// L1 (no effect on results; `p` need not be dereferenceable). L1, not
    /// L2: the fused norm loops prefetch 4 KiB ahead per stream and the
    /// elementwise loops 2 KiB, which L1 holds beside the rows being
    /// computed, and on a Zen 5 the L2 hint left the next row's loads
    /// missing (f32 norms 10-15% slower, 16-bit no better;
    /// docs/architecture.md, "Measured choices"). The norms' separate-pass loops (f32) prefetch
    /// the whole next row; what L1 cannot hold of it stays in L2.
    #[inline(always)]
    fn prefetch(p: *const u8) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: prefetch is SSE (baseline on x86_64) and never faults.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p as *const i8)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = p;
    }
    /// Lane-wise `self + o`.
    fn add(self, o: Self) -> Self;
    /// Lane-wise `self - o`.
    fn sub(self, o: Self) -> Self;
    /// Lane-wise `self * o`.
    fn mul(self, o: Self) -> Self;
    /// Lane-wise IEEE `self / o`.
    fn div(self, o: Self) -> Self;
    /// Lane-wise IEEE square root.
    fn sqrt(self) -> Self;
    /// Lane-wise fused `self * b + c`, rounded once (IEEE fusedMultiplyAdd)
    /// on every ISA: hardware FMA on AVX2, AVX-512 and NEON, an exact
    /// software form on the portable lanes (`math::fma_f32`; the FMA
    /// instruction when built for aarch64, whose baseline has it). The matmul's
    /// one rounding per product is this, so its bits are the same on all.
    fn mul_add(self, b: Self, c: Self) -> Self;
    /// Lane-wise minimum. Which operand a lane holding NaN yields, and which
    /// zero wins, are the ISA's (callers discard or normalize such lanes).
    fn min(self, o: Self) -> Self;
    /// Lane-wise maximum (NaN and zeros as `min`).
    fn max(self, o: Self) -> Self;
    /// The fixed fold: lanes `i + 8` onto `i`, then `i + 4`, `i + 2`, `i + 1`.
    fn fold(self) -> f32;
    /// Adds lane `i`'s square, in f64, to `sums[i]`: the square of an f32 is
    /// exact in f64, so the f64 addition is the only rounding (no FMA), and
    /// every ISA gives the same bits. The x86 lanes widen in registers; a
    /// generic form went through memory, its upper half rebuilt from
    /// broadcasts and blends (grad_stats at twice its read floor).
    #[inline(always)]
    fn add_squares_f64(self, sums: &mut [f64; GROUP]) {
        let mut v = [0f32; GROUP];
        self.store(&mut v);
        for (s, &e) in sums.iter_mut().zip(v.iter()) {
            let d = e as f64;
            // Separate mul and add: Rust never contracts them into an FMA.
            *s += d * d;
        }
    }
    /// Lane-wise `if self < o { a } else { b }` with IEEE `<` (false when
    /// either side is NaN), so NaN lanes take `b` on every ISA.
    fn select_lt(self, o: Self, a: Self, b: Self) -> Self;
    /// Lane-wise `2^n` for lanes holding an integral `n` in -126..=127,
    /// exact (the exponent field `n + 127`). Other lanes give a power of two
    /// or +Inf, never NaN (math.rs keeps its lanes in range).
    fn pow2i(self) -> Self;
    /// Lane-wise `if self < lo { lo } else if hi < self { hi } else { self }`
    /// (two `select_lt`s: NaN lanes stay NaN). x86 does it with max and min,
    /// whose NaN rule (the second operand) gives the same lanes.
    #[inline(always)]
    fn clamp(self, lo: Self, hi: Self) -> Self {
        let v = self.select_lt(lo, lo, self);
        hi.select_lt(v, hi, v)
    }
    /// Lane-wise `if self < lo { lo } else { self }`: `clamp`'s lower side
    /// (a NaN lane stays NaN), one `max` on x86 where the select is a
    /// compare and a blend on the exp's critical path.
    #[inline(always)]
    fn at_least(self, lo: Self) -> Self {
        self.select_lt(lo, lo, self)
    }
    /// Lane-wise nearest integer, ties to even, for |self| < 2^22: adding
    /// and subtracting 1.5 * 2^23 (AVX-512: one `vrndscaleps`, the same
    /// values; only the sign of a zero may differ, which `math` never sees).
    #[inline(always)]
    fn round_even(self) -> Self {
        let r = Self::splat(ROUND_BIAS);
        self.add(r).sub(r)
    }
    /// Lane-wise `self * 2^n` rounded once, for `self` in [0.5, 2) and `n`
    /// integral in -252..=254: `2^h` then `2^(n-h)` with `h = n / 2` rounded
    /// (the first product is exact, the second rounds once, so subnormal
    /// results are rounded like any other). AVX-512's `vscalefps` computes
    /// the same correctly rounded product in one instruction.
    #[inline(always)]
    fn ldexp(self, n: Self) -> Self {
        let h = n.mul(Self::splat(0.5)).round_even();
        self.mul(h.pow2i()).mul(n.sub(h).pow2i())
    }
}

/// 1.5 * 2^23 (`Lanes::round_even`).
const ROUND_BIAS: f32 = 12_582_912.0;

pub mod math;

/// The lanes' loads and stores of one float element type (internal; the
/// public face of these types is the sealed `Float`, which requires this).
pub trait LaneElem: Sized {
    /// Loads sixteen elements widened to f32.
    fn load<L: Lanes>(src: &[Self; GROUP]) -> L;
    /// Stores sixteen lanes rounded to this type.
    fn store<L: Lanes>(v: L, dst: &mut [Self; GROUP]);
    /// Two groups in order, as one line where the ISA can; with `STREAM`,
    /// streamed as whole lines when `dst` is 64-byte aligned.
    fn put2<L: Lanes, const STREAM: bool>(lo: L, hi: L, dst: &mut [Self; 2 * GROUP]);
    /// Every lane rounded to this type and widened back (identity for f32).
    fn round<L: Lanes>(v: L) -> L;
    /// Whether `load_line` / `put_line` keep elements in order on `L`
    /// (`Lanes::BF16_LINE_IN_ORDER` for bf16; f32 and f16 always do). Two
    /// types whose answers agree have the same line order.
    #[inline(always)]
    fn line_in_order<L: Lanes>() -> bool {
        true
    }
    /// 32 elements widened into two vectors in `L`'s line order for this
    /// type (`Lanes::load_line_bf16`); in order by default.
    #[inline(always)]
    fn load_line<L: Lanes>(src: &[Self; 2 * GROUP]) -> (L, L) {
        let (g, _) = src.as_chunks::<GROUP>();
        (Self::load(&g[0]), Self::load(&g[1]))
    }
    /// The inverse of `load_line`, rounding; streamed as `put2` with
    /// `STREAM`.
    #[inline(always)]
    fn put_line<L: Lanes, const STREAM: bool>(lo: L, hi: L, dst: &mut [Self; 2 * GROUP]) {
        Self::put2::<L, STREAM>(lo, hi, dst)
    }
    /// `lo`, `hi` (in line order) rounded to this type: stored as `put_line`
    /// stores them when `dst` is given, and returned widened (`round` of
    /// each). One conversion serves both where the ISA can.
    #[inline(always)]
    fn round_line<L: Lanes, const STREAM: bool>(
        lo: L,
        hi: L,
        dst: Option<&mut [Self; 2 * GROUP]>,
    ) -> (L, L) {
        if let Some(d) = dst {
            Self::put_line::<L, STREAM>(lo, hi, d);
        }
        (Self::round(lo), Self::round(hi))
    }
}

impl LaneElem for f32 {
    #[inline(always)]
    fn load<L: Lanes>(src: &[f32; GROUP]) -> L {
        L::load(src)
    }
    #[inline(always)]
    fn store<L: Lanes>(v: L, dst: &mut [f32; GROUP]) {
        v.store(dst)
    }
    #[inline(always)]
    fn round<L: Lanes>(v: L) -> L {
        v
    }
    #[inline(always)]
    fn put2<L: Lanes, const STREAM: bool>(lo: L, hi: L, dst: &mut [f32; 2 * GROUP]) {
        let (a, b) = dst.split_at_mut(GROUP);
        if let (Ok(a), Ok(b)) = (a.try_into(), b.try_into()) {
            if STREAM {
                lo.stream(a);
                hi.stream(b);
            } else {
                lo.store(a);
                hi.store(b);
            }
        }
    }
}

impl LaneElem for bf16 {
    #[inline(always)]
    fn load<L: Lanes>(src: &[bf16; GROUP]) -> L {
        L::load_bf16(src)
    }
    #[inline(always)]
    fn store<L: Lanes>(v: L, dst: &mut [bf16; GROUP]) {
        v.store_bf16(dst)
    }
    #[inline(always)]
    fn round<L: Lanes>(v: L) -> L {
        v.round_bf16()
    }
    #[inline(always)]
    fn put2<L: Lanes, const STREAM: bool>(lo: L, hi: L, dst: &mut [bf16; 2 * GROUP]) {
        lo.put2_bf16::<STREAM>(hi, dst)
    }
    #[inline(always)]
    fn line_in_order<L: Lanes>() -> bool {
        L::BF16_LINE_IN_ORDER
    }
    #[inline(always)]
    fn load_line<L: Lanes>(src: &[bf16; 2 * GROUP]) -> (L, L) {
        L::load_line_bf16(src)
    }
    #[inline(always)]
    fn put_line<L: Lanes, const STREAM: bool>(lo: L, hi: L, dst: &mut [bf16; 2 * GROUP]) {
        L::put_line_bf16::<STREAM>(lo, hi, dst)
    }
    #[inline(always)]
    fn round_line<L: Lanes, const STREAM: bool>(
        lo: L,
        hi: L,
        dst: Option<&mut [bf16; 2 * GROUP]>,
    ) -> (L, L) {
        L::round_line_bf16::<STREAM>(lo, hi, dst)
    }
}

impl LaneElem for f16 {
    #[inline(always)]
    fn load<L: Lanes>(src: &[f16; GROUP]) -> L {
        L::load_f16(src)
    }
    #[inline(always)]
    fn store<L: Lanes>(v: L, dst: &mut [f16; GROUP]) {
        v.store_f16(dst)
    }
    #[inline(always)]
    fn round<L: Lanes>(v: L) -> L {
        v.round_f16()
    }
    #[inline(always)]
    fn put2<L: Lanes, const STREAM: bool>(lo: L, hi: L, dst: &mut [f16; 2 * GROUP]) {
        lo.put2_f16::<STREAM>(hi, dst)
    }
}

/// Widens `src` into `dst[..src.len()]` and zeroes the rest of `dst` up to
/// the next multiple of 16 (`dst.len()` must be `src.len()` rounded up to 16).
/// The zero padding keeps reductions exact: adding +0.0 never changes an
/// accumulator that started at +0.0.
#[inline(always)]
pub fn widen_into<L: Lanes, T: Float>(src: &[T], dst: &mut [f32]) {
    let (sg, st) = src.as_chunks::<GROUP>();
    let (dg, dt) = dst.as_chunks_mut::<GROUP>();
    for (s, d) in sg.iter().zip(dg.iter_mut()) {
        T::load::<L>(s).store(d);
    }
    if !st.is_empty() {
        if let Some(d) = dg.get_mut(sg.len()) {
            for (o, i) in d
                .iter_mut()
                .zip(st.iter().map(|v| v.to_f32()).chain(core::iter::repeat(0.0)))
            {
                *o = i;
            }
        }
    }
    dt.fill(0.0);
}

/// The fixed row-sum pattern: each group of 16 is added lane-wise into a
/// segment accumulator; every `SEGMENT_GROUPS` groups the segment's partial is
/// merged into a binary counter of partials (pairwise summation whose tree is
/// fixed by the number of groups alone); `finish` adds the pending partials
/// from the smallest up and folds the 16 lanes in one fixed tree. The result
/// depends only on the values and N, never on tiling, chunking or ISA.
pub struct RowSum<L: Lanes> {
    acc: L,
    in_segment: usize,
    segments: u64,
    depth: usize,
    /// Pending partials; slots `..depth` are written. Left uninitialised:
    /// zeroing 48 vectors (a 3 KiB memset) per row was a fixed cost of
    /// about one memory latency per row on a Zen 5 (the `rep stosb` did not
    /// overlap the row's streams).
    stack: [MaybeUninit<L>; 48],
}

impl<L: Lanes> RowSum<L> {
    /// An empty sum.
    #[inline(always)]
    pub fn new() -> Self {
        RowSum {
            acc: L::splat(0.0),
            in_segment: 0,
            segments: 0,
            depth: 0,
            stack: [const { MaybeUninit::uninit() }; 48],
        }
    }

    /// Adds the next group of 16 lanes.
    #[inline(always)]
    pub fn push(&mut self, v: L) {
        self.acc = self.acc.add(v);
        self.in_segment += 1;
        if self.in_segment == SEGMENT_GROUPS {
            self.close_segment();
        }
    }

    /// Groups that still fit in the current segment (>= 1).
    #[inline(always)]
    pub fn room(&self) -> usize {
        SEGMENT_GROUPS - self.in_segment
    }

    /// The current segment's running sum, to be carried in a register by a
    /// loop of at most `room()` additions and handed back with `commit`.
    #[inline(always)]
    pub fn acc(&self) -> L {
        self.acc
    }

    /// Takes back the running sum after `added` more groups (<= `room()`).
    #[inline(always)]
    pub fn commit(&mut self, acc: L, added: usize) {
        self.acc = acc;
        self.in_segment += added;
        if self.in_segment >= SEGMENT_GROUPS {
            self.close_segment();
        }
    }

    #[inline(always)]
    fn close_segment(&mut self) {
        let mut p = self.acc;
        let mut c = self.segments;
        while c & 1 == 1 && self.depth > 0 {
            p = self.slot(self.depth - 1).add(p);
            self.depth -= 1;
            c >>= 1;
        }
        if let Some(slot) = self.stack.get_mut(self.depth) {
            *slot = MaybeUninit::new(p);
            self.depth += 1;
        }
        self.segments += 1;
        self.acc = L::splat(0.0);
        self.in_segment = 0;
    }

    /// The total; the sum is left empty. By reference, not by value: moving
    /// the 3 KiB of pending partials into the call was a `memcpy` per row
    /// that LLVM did not elide (on a Cascade Lake, without it an
    /// L2-resident 64x4096 bf16 RmsNorm is 12% faster, a decode row 0.15 us).
    #[inline(always)]
    pub fn finish(&mut self) -> f32 {
        if self.in_segment > 0 {
            self.close_segment();
        }
        let mut r = L::splat(0.0);
        if self.depth > 0 {
            r = self.slot(self.depth - 1);
            for i in (0..self.depth - 1).rev() {
                r = self.slot(i).add(r);
            }
        }
        self.depth = 0;
        self.segments = 0;
        r.fold()
    }

    /// Pending partial `i` (`i < depth`).
    #[inline(always)]
    fn slot(&self, i: usize) -> L {
        debug_assert!(i < self.depth);
        // SAFETY: slots below `depth` were written by `close_segment` (the
        // only place `depth` grows, right after writing the slot), and
        // every caller passes `i < depth`.
        unsafe { self.stack[i].assume_init() }
    }
}

impl<L: Lanes> Default for RowSum<L> {
    fn default() -> Self {
        Self::new()
    }
}

/// Adds `$body` for `$k` in `0..$n`, in order, to the `RowSum` `$s`: the
/// same sum as `$n` calls of `push`, with the running sum in a local. A
/// macro, not a closure, so the body always inlines into the ISA context.
///
/// `push_groups!(paired s, ...)` sums two whole segments side by side where
/// the row has them: a segment's additions are one dependent chain, the next
/// segment's chain does not depend on it (only the merges are ordered, and
/// `commit` keeps that order), so the row's latency halves with the same
/// bits. For a sum that waits on that chain alone (the norms' sum of
/// squares: a decode row, f32 rows); a heavier term is bound by its loads
/// and arithmetic instead, and a second stream only spreads its reads.
macro_rules! push_groups {
    (@from $i:expr, $s:expr, $n:expr, |$k:ident| $body:expr) => {{
        let n: usize = $n;
        let mut i: usize = $i;
        while i < n {
            let take = $s.room().min(n - i);
            let mut acc = $s.acc();
            for $k in i..i + take {
                acc = $crate::lanes::Lanes::add(acc, $body);
            }
            $s.commit(acc, take);
            i += take;
        }
    }};
    (paired $s:expr, $n:expr, |$k:ident| $body:expr) => {{
        const SEG: usize = $crate::lanes::SEGMENT_GROUPS;
        let n: usize = $n;
        let mut i = 0usize;
        while $s.room() == SEG && n - i >= 2 * SEG {
            // At a segment start the running sum is +0.0: both start there.
            let (mut a0, mut a1) = ($s.acc(), $s.acc());
            for j in i..i + SEG {
                a0 = $crate::lanes::Lanes::add(a0, {
                    let $k = j;
                    $body
                });
                a1 = $crate::lanes::Lanes::add(a1, {
                    let $k = j + SEG;
                    $body
                });
            }
            $s.commit(a0, SEG);
            $s.commit(a1, SEG);
            i += 2 * SEG;
        }
        $crate::lanes::push_groups!(@from i, $s, n, |$k| $body)
    }};
    ($s:expr, $n:expr, |$k:ident| $body:expr) => {{
        $crate::lanes::push_groups!(@from 0usize, $s, $n, |$k| $body)
    }};
}
pub(crate) use push_groups;

/// Walks a row of `$n` elements for a second pass while summing another
/// row's terms into the `RowSum` `$s` (a row's pass 2 fused with the next
/// row's pass 1). Per pair of groups from the row start, `$pair` (with `$p`,
/// the pair's first column) does its pass-2 work and evaluates to the other
/// row's two terms, `(group p, group p + 16)`; per remaining window
/// (`$j`, `$len <= 16`), `$one` does the same with one term. The terms go in
/// in order and in the segments `push` would use (segments hold an even
/// number of groups, so a pair never straddles one): the sum has the bits of
/// pushing them one by one. A macro so the bodies inline into the ISA context.
macro_rules! fused_row {
    ($s:ident, $n:expr, |$p:ident| $pair:expr, |$j:ident, $len:ident| $one:expr) => {{
        const G: usize = $crate::lanes::GROUP;
        let n: usize = $n;
        let pairs = n / (2 * G);
        let mut k = 0usize;
        while k < pairs {
            let take = ($s.room() / 2).min(pairs - k);
            let mut acc = $s.acc();
            for q in k..k + take {
                let $p = q * 2 * G;
                let (a, b) = $pair;
                acc = $crate::lanes::Lanes::add($crate::lanes::Lanes::add(acc, a), b);
            }
            $s.commit(acc, 2 * take);
            k += take;
        }
        let mut at = pairs * 2 * G;
        while at < n {
            let ($j, $len) = (at, (n - at).min(G));
            let t = $one;
            $s.push(t);
            at += $len;
        }
    }};
}
pub(crate) use fused_row;

/// IEEE single-precision square root without `std` (sqrtss on x86_64, the
/// correctly rounded software root elsewhere: identical bits).
#[inline(always)]
pub fn sqrt_f32(x: f32) -> f32 {
    wide::f32x4::splat(x).sqrt().to_array()[0]
}

/// IEEE double-precision square root without `std` (reference model).
#[inline(always)]
pub fn sqrt_f64(x: f64) -> f64 {
    wide::f64x2::splat(x).sqrt().to_array()[0]
}

/// `1 / sqrt(sum_sq / n + eps)` in f32, IEEE division and root.
#[inline(always)]
pub fn rstd_f32(sum_sq: f32, n: usize, eps: f32) -> f32 {
    1.0 / sqrt_f32(sum_sq / n as f32 + eps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Float;

    fn bits_stream(mut s: u32, n: usize) -> impl Iterator<Item = u32> {
        (0..n).map(move |_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        })
    }

    /// The SIMD conversions of every ISA this machine has equal the scalar
    /// definitions bit for bit, NaN payloads included.
    #[test]
    fn every_isa_converts_like_scalar() {
        for isa in Isa::ALL {
            let Ok(a) = detect::resolve(Some(isa)) else {
                continue;
            };
            // SAFETY: `a` proves the ISA is available.
            dispatch_isa!(a, L => unsafe { L::enter(conversions_match_scalar::<L>) });
        }
    }

    #[test]
    fn every_isa_transposes_16_by_16() {
        for isa in Isa::ALL {
            let Ok(a) = detect::resolve(Some(isa)) else {
                continue;
            };
            // SAFETY: `a` proves the ISA is available.
            dispatch_isa!(a, L => unsafe { L::enter(transpose_moves_each_lane::<L>) });
        }
    }

    fn transpose_moves_each_lane<L: Lanes>() {
        // Distinct bit patterns, NaN payloads and -0 among them.
        let x =
            |i: usize, j: usize| f32::from_bits(0x7fc0_0000 ^ ((i * 16 + j) as u32 * 0x0101_0101));
        let rows: [L; GROUP] =
            core::array::from_fn(|i| L::load(&core::array::from_fn(|j| x(i, j))));
        let t = L::transpose16(&rows);
        for (j, v) in t.iter().enumerate() {
            let mut out = [0f32; GROUP];
            v.store(&mut out);
            for (i, o) in out.iter().enumerate() {
                assert_eq!(
                    o.to_bits(),
                    x(i, j).to_bits(),
                    "{} ({i}, {j})",
                    L::ISA.name()
                );
            }
        }
    }

    /// Normals, subnormals, Inf, NaN with payloads, ties.
    fn conversions_match_scalar<L: Lanes>() {
        let specials = [
            0x7f80_0000u32,
            0xff80_0000,
            0x7fc0_0001,
            0x7f80_0001,
            0xff80_ffff,
            0xffff_ffff,
            0x7f7f_ffff,
            0x3f80_8000,
            0x3f81_8000,
            0x0000_0001,
            0x8000_0000,
        ];
        let all: [u32; 4096] = core::array::from_fn(|i| {
            if i < specials.len() {
                specials[i]
            } else {
                bits_stream(i as u32 * 7919 + 1, 1).next().unwrap_or(0)
            }
        });
        for chunk in all.chunks_exact(GROUP) {
            let a: [f32; GROUP] = core::array::from_fn(|i| f32::from_bits(chunk[i]));
            let v = L::load(&a);
            let mut b = [bf16::ZERO; GROUP];
            v.store_bf16(&mut b);
            let mut h = [f16::ZERO; GROUP];
            v.store_f16(&mut h);
            for i in 0..GROUP {
                assert_eq!(
                    b[i].to_bits(),
                    <bf16 as Float>::from_f32(a[i]).to_bits(),
                    "{:#x}",
                    chunk[i]
                );
                assert_eq!(
                    h[i].to_bits(),
                    f16::from_f32(a[i]).to_bits(),
                    "{:#x}",
                    chunk[i]
                );
            }
            // In-register rounding: the same bits as a store and a load.
            let mut r = [0f32; GROUP];
            v.round_bf16().store(&mut r);
            for i in 0..GROUP {
                assert_eq!(
                    r[i].to_bits(),
                    (b[i].to_bits() as u32) << 16,
                    "{:#x}",
                    chunk[i]
                );
            }
            v.round_f16().store(&mut r);
            for i in 0..GROUP {
                assert_eq!(r[i].to_bits(), h[i].to_f32().to_bits(), "{:#x}", chunk[i]);
            }
            let w = L::load_bf16(&b);
            let mut back = [0f32; GROUP];
            w.store(&mut back);
            for i in 0..GROUP {
                assert_eq!(back[i].to_bits(), (b[i].to_bits() as u32) << 16);
            }
            L::load_f16(&h).store(&mut back);
            for i in 0..GROUP {
                assert_eq!(back[i].to_bits(), h[i].to_f32().to_bits());
            }
            let mut sums = [0f32; GROUP];
            L::load(&a)
                .add(L::load(&back))
                .mul(L::load(&a))
                .store(&mut sums);
            let f = L::load(&sums).fold();
            let p = Portable::load(&sums).fold();
            assert!(f.to_bits() == p.to_bits() || (f.is_nan() && p.is_nan()));
        }
    }

    /// Where `L`'s bf16 line order puts each element: lane `k` of
    /// `(lo, hi)` (k < 16 in `lo`) holds element `perm[k]`.
    pub(crate) fn line_perm<L: Lanes>() -> [usize; 2 * GROUP] {
        let idx: [bf16; 2 * GROUP] = core::array::from_fn(|i| bf16::from_f32(i as f32));
        let (lo, hi) = L::load_line_bf16(&idx);
        let (mut a, mut b) = ([0f32; GROUP], [0f32; GROUP]);
        lo.store(&mut a);
        hi.store(&mut b);
        core::array::from_fn(|k| if k < GROUP { a[k] } else { b[k - GROUP] } as usize)
    }

    /// The line functions on 32 f32 bit patterns: `put_line_bf16` (ordinary
    /// and streaming) writes element `i` as `bf16_bits_rne`, and
    /// `load_line_bf16` widens what it wrote exactly, in the same order.
    /// Returns the number of elements that differ.
    fn line_mismatches<L: Lanes>(perm: &[usize; 2 * GROUP], x: &[u32; 2 * GROUP]) -> u64 {
        let lanes: [f32; 2 * GROUP] = core::array::from_fn(|k| f32::from_bits(x[perm[k]]));
        let (lo_a, hi_a) = lanes.split_at(GROUP);
        let (lo, hi) = match (lo_a.try_into(), hi_a.try_into()) {
            (Ok(a), Ok(b)) => (L::load(a), L::load(b)),
            _ => return u64::MAX,
        };
        let mut bad = 0;
        #[repr(align(64))]
        struct Line([bf16; 2 * GROUP]);
        let (mut o, mut s) = (Line([bf16::ZERO; 2 * GROUP]), Line([bf16::ZERO; 2 * GROUP]));
        L::put_line_bf16::<false>(lo, hi, &mut o.0);
        L::put_line_bf16::<true>(lo, hi, &mut s.0);
        L::stream_fence();
        for ((xi, a), b) in x.iter().zip(&o.0).zip(&s.0) {
            let want = crate::dtype::bf16_bits_rne(*xi);
            bad += u64::from(a.to_bits() != want) + u64::from(b.to_bits() != want);
        }
        let (wl, wh) = L::load_line_bf16(&o.0);
        let (mut a, mut b) = ([0f32; GROUP], [0f32; GROUP]);
        wl.store(&mut a);
        wh.store(&mut b);
        for k in 0..2 * GROUP {
            let got = if k < GROUP { a[k] } else { b[k - GROUP] };
            bad += u64::from(got.to_bits() != u32::from(o.0[perm[k]].to_bits()) << 16);
        }
        // round_line_bf16: the same line stored (or not), and each lane's
        // round_bf16 returned.
        let mut r = Line([bf16::ZERO; 2 * GROUP]);
        let (rl, rh) = L::round_line_bf16::<false>(lo, hi, Some(&mut r.0));
        let (sl, sh) = L::round_line_bf16::<true>(lo, hi, None);
        bad +=
            r.0.iter()
                .zip(&o.0)
                .filter(|(p, q)| p.to_bits() != q.to_bits())
                .count() as u64;
        for (got, want) in [(rl, lo), (rh, hi), (sl, lo), (sh, hi)] {
            let (mut g, mut w) = ([0f32; GROUP], [0f32; GROUP]);
            got.store(&mut g);
            want.round_bf16().store(&mut w);
            bad += g
                .iter()
                .zip(&w)
                .filter(|(p, q)| p.to_bits() != q.to_bits())
                .count() as u64;
        }
        bad
    }

    /// Every ISA's line order is a permutation, and its line functions
    /// round and widen like the scalar definitions on specials and random
    /// bit patterns (exhaustively for AVX-512: `lanes::x86`'s tests).
    #[test]
    fn every_isa_line_functions_match_scalar() {
        for isa in Isa::ALL {
            let Ok(a) = detect::resolve(Some(isa)) else {
                continue;
            };
            // SAFETY: `a` proves the ISA is available.
            dispatch_isa!(a, L => unsafe {
                L::enter(|| {
                    let perm = line_perm::<L>();
                    let mut seen = [false; 2 * GROUP];
                    for &p in &perm {
                        seen[p] = true;
                    }
                    assert!(seen.iter().all(|&s| s), "{isa:?}: {perm:?}");
                    let specials = [
                        0x7f80_0000u32, 0xff80_0000, 0x7fc0_0001, 0xffff_ffff, 0x7f7f_ffff,
                        0x3f80_8000, 0x3f81_8000, 0x0000_0001, 0x8000_0000, 0x007f_ffff,
                        0x0000_8000, 0x8001_8000, 0x7f7f_8000, 0xff80_0001,
                    ];
                    let mut bits = bits_stream(99, 1 << 16);
                    for r in 0..(1 << 11) {
                        let x: [u32; 2 * GROUP] = core::array::from_fn(|i| {
                            let b = bits.next().unwrap_or(0);
                            if r == 0 { specials.get(i).copied().unwrap_or(b) } else { b }
                        });
                        assert_eq!(line_mismatches::<L>(&perm, &x), 0, "{isa:?}: {x:x?}");
                    }
                })
            });
        }
    }

    #[test]
    fn row_sum_is_order_fixed_and_accurate() {
        // 110000 elements: the pairwise segment tree keeps the sum close.
        let n = 110_000;
        let xs: [f32; 16] = core::array::from_fn(|i| 1.0 + i as f32 * 1e-3);
        let mut s = RowSum::<Portable>::new();
        for _ in 0..n / GROUP {
            s.push(Portable::load(&xs));
        }
        let got = s.finish() as f64;
        let want = (n / GROUP) as f64 * xs.iter().map(|v| *v as f64).sum::<f64>();
        assert!(((got - want) / want).abs() < 1e-6, "{got} vs {want}");
    }

    /// `push_groups!(paired ...)` (two segments side by side) has the bits of
    /// pushing the groups one by one, for lengths around whole segments.
    #[test]
    fn paired_segments_sum_like_push() {
        let seg = SEGMENT_GROUPS;
        for groups in [
            0,
            1,
            seg - 1,
            seg,
            2 * seg - 1,
            2 * seg,
            2 * seg + 3,
            5 * seg + 7,
        ] {
            let mut bits = bits_stream(groups as u32 + 11, groups * GROUP);
            // Finite values of mixed magnitude, so the order shows in the bits.
            let v: std::vec::Vec<f32> = (0..groups * GROUP)
                .map(|_| f32::from_bits(bits.next().unwrap_or(0) & 0x8fff_ffff | 0x3000_0000))
                .collect();
            let group = |k: usize| -> Portable {
                let mut a = [0f32; GROUP];
                a.copy_from_slice(&v[k * GROUP..(k + 1) * GROUP]);
                Portable::load(&a)
            };
            let mut one = RowSum::<Portable>::new();
            for k in 0..groups {
                one.push(group(k));
            }
            let mut paired = RowSum::<Portable>::new();
            push_groups!(paired paired, groups, |k| group(k));
            assert_eq!(
                paired.finish().to_bits(),
                one.finish().to_bits(),
                "{groups} groups"
            );
        }
    }
}
