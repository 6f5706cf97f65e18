//! The microkernel: an `MR x NR` block of c held in registers while K runs,
//! one fused multiply-add per product (`Lanes::mul_add`), k ascending. It is
//! written once; `Tile` gives each lanes type its register blocking (the
//! only per-ISA choice), sized to its register file:
//! - AVX-512 (32 zmm): 14 x 32 = 28 accumulators, 2 B vectors, 1 broadcast;
//! - AVX2 (16 ymm; a lanes value is 2 ymm): 6 x 16 = 12 + 2 + 1;
//! - NEON (32 q; a value is 4 q): 6 x 16 = 24 + 4 + 1;
//! - portable: 4 x 16 (its FMA is software; size matters little).

use super::pack::{flush_lanes, ftz_fma, FTZ_SCALE, KC};
use crate::dtype::Float;
use crate::lanes::{Lanes, GROUP};

/// One microkernel call: `dst[r][c] = init[r][c] + sum_k a[k][r] b[k][c]`
/// over the `rows x cols` corner of the `MR x NR` block.
#[derive(Clone, Copy)]
pub(crate) struct Micro<D> {
    /// K of this slice.
    pub kc: usize,
    /// The packed A micro-panel: `kc` groups of `MR` rows, or (`AR`) `MR`
    /// rows of stride `pack::KC`.
    pub a: *const f32,
    /// The packed B micro-panel: `kc` rows of `NR`.
    pub b: *const f32,
    /// The sums so far (f32, row stride `ldi`), or NULL to start at 0.
    pub init: *const f32,
    /// Row stride of `init`, in elements.
    pub ldi: usize,
    /// Where the block goes (row stride `ldd`), rounded once to `D`.
    pub dst: *mut D,
    /// Row stride of `dst`, in elements.
    pub ldd: usize,
    /// Valid rows (<= MR) and columns (<= NR).
    pub rows: usize,
    /// Valid columns.
    pub cols: usize,
}

/// A lanes type's register blocking.
pub(crate) trait Tile: Lanes {
    /// Rows of the block (divides `MATMUL_MC`).
    const MR: usize;
    /// Columns of the block (a multiple of 16 dividing `MATMUL_NC`).
    const NR: usize;
    /// Whether `pair_block` runs VDPBF16PS (the bf16 pair dot in hardware,
    /// on panels of bf16 pairs, `pairs.rs`); else the pair dot is the FMA
    /// chain on `DOT` panels with `FLUSH`.
    const PAIRS: bool = false;

    /// Runs the microkernel: the FMA chain (each sum flushed under
    /// `FLUSH`), or on pair panels (`PAIRS`) VDPBF16PS's pair dot in
    /// hardware (`X86_PAIRS`) or Arm's (`ARM_PAIRS`).
    ///
    /// # Safety
    /// Inside `Self::enter`; the panels hold `kc * MR` and `kc * NR` f32
    /// (pairs under `PAIRS`), `init` (when not NULL) and `dst` the
    /// `rows x cols` corner.
    unsafe fn micro<D: Float, const AR: bool, const FLUSH: bool, const PAIRS: u8>(u: &Micro<D>);

    /// A full block of the hardware pair dot (`PAIRS` lanes only).
    ///
    /// # Safety
    /// As `block`'s, on pair panels; `Self::PAIRS`.
    #[inline(always)]
    unsafe fn pair_block<const AR: bool>(_u: &Micro<f32>) {}

    /// A full block of Arm's pair dot (`MatmulMath::Bf16DotArm`): `BFMMLA`
    /// on the NEON BF16 lanes, the exact scalar model on every other.
    ///
    /// # Safety
    /// As `block`'s, on pair panels.
    #[inline(always)]
    unsafe fn arm_block<const AR: bool>(u: &Micro<f32>) {
        // SAFETY: forwarded; every tile's MR x NR fits the model's block.
        unsafe { super::arm_dot::model_block::<AR>(u, Self::MR, Self::NR) }
    }
}

/// `Tile::micro`'s `PAIRS`: the chain's panels.
pub(crate) const NO_PAIRS: u8 = 0;
/// `Tile::micro`'s `PAIRS`: VDPBF16PS on pair panels.
pub(crate) const X86_PAIRS: u8 = 1;
/// `Tile::micro`'s `PAIRS`: Arm's pair dot on pair panels.
pub(crate) const ARM_PAIRS: u8 = 2;
/// `Tile::micro`'s `PAIRS`: the chain's panels under the pair dot, each
/// FMA flushed by the hardware (`Lanes::enter_flushing`; `FLUSH` off).
pub(crate) const FLUSHED_CHAIN: u8 = 3;

/// `f` in L's context, a function of its own (`lanes::enter_apart`), with
/// the hardware's flush on under `FLUSHED_CHAIN`.
///
/// # Safety
/// As `Lanes::enter`.
#[inline(always)]
unsafe fn apart<L: Tile, const PAIRS: u8>(f: impl FnOnce()) {
    // SAFETY: the caller's.
    unsafe {
        if PAIRS == FLUSHED_CHAIN {
            crate::lanes::enter_apart_flushing::<L, _>(f)
        } else {
            crate::lanes::enter_apart::<L, _>(f)
        }
    }
}

/// `Tile` for a lanes type with `MR` rows and `NG` groups of 16 columns.
macro_rules! tile {
    ($(#[$m:meta])* $t:ty, $mr:literal, $ng:literal $(, pairs = $pairs:ident)? $(, arm = $arm:ident)?) => {
        $(#[$m])*
        impl Tile for $t {
            const MR: usize = $mr;
            const NR: usize = $ng * GROUP;
            $(const PAIRS: bool = { let _ = stringify!($pairs); true };)?
            #[inline(always)]
            unsafe fn micro<D: Float, const AR: bool, const FLUSH: bool, const PAIRS: u8>(
                u: &Micro<D>,
            ) {
                // SAFETY: forwarded.
                unsafe { micro::<Self, D, AR, FLUSH, PAIRS, $mr, $ng>(u) }
            }
            $(
            #[inline(always)]
            unsafe fn pair_block<const AR: bool>(u: &Micro<f32>) {
                // SAFETY: forwarded (AVX512-BF16: these lanes).
                unsafe { super::pairs::$pairs::<AR, $mr, $ng>(u) }
            }
            )?
            $(
            #[inline(always)]
            unsafe fn arm_block<const AR: bool>(u: &Micro<f32>) {
                // SAFETY: forwarded (FEAT_BF16: these lanes; 16 columns).
                unsafe { super::arm_dot::$arm::<AR, $mr>(u) }
            }
            )?
        }
    };
}

tile!(crate::lanes::Portable, 4, 1);
tile!(
    #[cfg(target_arch = "x86_64")]
    crate::lanes::Avx2,
    6,
    1
);
tile!(
    #[cfg(target_arch = "x86_64")]
    crate::lanes::Avx512,
    14,
    2
);
tile!(
    #[cfg(target_arch = "x86_64")]
    crate::lanes::Avx512Bf16,
    14,
    2,
    pairs = dpbf16_block
);
tile!(
    #[cfg(target_arch = "aarch64")]
    crate::lanes::Neon,
    6,
    1
);
tile!(
    #[cfg(target_arch = "aarch64")]
    crate::lanes::NeonBf16,
    6,
    1,
    arm = bf16_block
);

/// A group of 16 f32 at `p`.
///
/// # Safety
/// `p` is valid for 16 reads.
#[inline(always)]
unsafe fn group<'a>(p: *const f32) -> &'a [f32; GROUP] {
    // SAFETY: the caller's.
    unsafe { &*(p as *const [f32; GROUP]) }
}

/// Most f32 of any lanes type's block (`MR * NR`).
const MAX_BLOCK: usize = 14 * 32;

/// The microkernel body. An f32 full block is summed in place; any other
/// (a corner, or a 16-bit c) through a full-size f32 buffer on the stack,
/// then copied out by the valid part, rounded once. So `block` has one
/// instantiation per A layout: with the 16-bit store inside it, LLVM kept
/// the accumulators on the stack (a store per FMA, half speed; measured).
///
/// # Safety
/// As `Tile::micro`.
#[inline(always)]
unsafe fn micro<
    L: Tile,
    D: Float,
    const AR: bool,
    const FLUSH: bool,
    const PAIRS: u8,
    const MR: usize,
    const NG: usize,
>(
    u: &Micro<D>,
) {
    let nr = NG * GROUP;
    let full = u.rows == MR && u.cols == nr;
    if full && D::DTYPE == crate::dtype::DType::F32 {
        let u = Micro::<f32> {
            kc: u.kc,
            a: u.a,
            b: u.b,
            init: u.init,
            ldi: u.ldi,
            dst: u.dst as *mut f32,
            ldd: u.ldd,
            rows: u.rows,
            cols: u.cols,
        };
        // SAFETY: forwarded (D is f32); a function of its own, in the
        // caller's ISA context.
        return unsafe {
            apart::<L, PAIRS>(
                #[inline(always)]
                || body::<L, AR, FLUSH, PAIRS, MR, NG>(&u),
            )
        };
    }
    debug_assert!(MR * nr <= MAX_BLOCK);
    let mut buf = [0f32; MAX_BLOCK];
    let p = buf.as_mut_ptr();
    let init = if u.init.is_null() {
        core::ptr::null()
    } else if full {
        u.init
    } else {
        for r in 0..u.rows {
            for c in 0..u.cols {
                // SAFETY: inside the valid corner.
                buf[r * nr + c] = unsafe { *u.init.add(r * u.ldi + c) };
            }
        }
        p as *const f32
    };
    let whole = Micro::<f32> {
        kc: u.kc,
        a: u.a,
        b: u.b,
        init,
        ldi: if full { u.ldi } else { nr },
        dst: p,
        ldd: nr,
        rows: MR,
        cols: nr,
    };
    // SAFETY: the buffer holds a full block.
    unsafe {
        apart::<L, PAIRS>(
            #[inline(always)]
            || body::<L, AR, FLUSH, PAIRS, MR, NG>(&whole),
        )
    };
    if full {
        for r in 0..MR {
            for g in 0..NG {
                // SAFETY: inside buf (MR x NR).
                let v = L::load(unsafe { group(p.add(r * nr + g * GROUP)) });
                // SAFETY: dst holds MR x NR.
                let d = unsafe { &mut *(u.dst.add(r * u.ldd + g * GROUP) as *mut [D; GROUP]) };
                D::store::<L>(v, d);
            }
        }
        return;
    }
    for r in 0..u.rows {
        for c in 0..u.cols {
            // SAFETY: inside the valid corner.
            unsafe { *u.dst.add(r * u.ldd + c) = D::from_f32(buf[r * nr + c]) };
        }
    }
}

/// A full block: the FMA chain, or a pair dot.
///
/// # Safety
/// As `block`.
#[inline(always)]
unsafe fn body<
    L: Tile,
    const AR: bool,
    const FLUSH: bool,
    const PAIRS: u8,
    const MR: usize,
    const NG: usize,
>(
    u: &Micro<f32>,
) {
    // SAFETY: forwarded.
    unsafe {
        match PAIRS {
            X86_PAIRS => L::pair_block::<AR>(u),
            ARM_PAIRS => L::arm_block::<AR>(u),
            _ => block::<L, AR, FLUSH, MR, NG>(u),
        }
    }
}

/// A full `MR x NR` block. Under `FLUSH` (the pair dot's emulation) the
/// starting sums are flushed (`pack::flush_lanes`) and each FMA is
/// VDPBF16PS's (`pack::ftz_fma`).
///
/// # Safety
/// As `Tile::micro`, with `rows == MR` and `cols == NR`.
#[inline(always)]
unsafe fn block<L: Lanes, const AR: bool, const FLUSH: bool, const MR: usize, const NG: usize>(
    u: &Micro<f32>,
) {
    let nr = NG * GROUP;
    let mut acc = [[L::splat(0.0); NG]; MR];
    if !u.init.is_null() {
        for (r, row) in acc.iter_mut().enumerate() {
            for (g, v) in row.iter_mut().enumerate() {
                // SAFETY: init holds MR x NR.
                *v = L::load(unsafe { group(u.init.add(r * u.ldi + g * GROUP)) });
                if FLUSH {
                    *v = flush_lanes(*v);
                }
            }
        }
    }
    let (mut a, mut b) = (u.a, u.b);
    // Steps two at a time, then the odd one: LLVM left the loop rolled,
    // and pairs ran 3-5% faster on Sapphire Rapids (fours: 2%).
    for (iters, unroll) in [(u.kc / 2, 2), (u.kc % 2, 1)] {
        for _ in 0..iters {
            for _ in 0..unroll {
                // SAFETY: the panels hold kc steps of MR and NR f32.
                let bv: [L; NG] =
                    core::array::from_fn(|g| L::load(unsafe { group(b.add(g * GROUP)) }));
                for (r, row) in acc.iter_mut().enumerate() {
                    // SAFETY: as above (row r of an AR panel at r * KC).
                    let av = L::splat(unsafe { *a.add(if AR { r * KC } else { r }) });
                    if FLUSH {
                        let a_big = av.mul(L::splat(FTZ_SCALE));
                        for (v, bg) in row.iter_mut().zip(&bv) {
                            *v = ftz_fma(av, a_big, *bg, *v);
                        }
                    } else {
                        for (v, bg) in row.iter_mut().zip(&bv) {
                            *v = av.mul_add(*bg, *v);
                        }
                    }
                }
                // SAFETY: one step further, still inside the panels (or one past).
                unsafe {
                    a = a.add(if AR { 1 } else { MR });
                    b = b.add(nr);
                }
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (g, v) in row.iter().enumerate() {
            // SAFETY: dst holds MR x NR.
            v.store(unsafe { &mut *(u.dst.add(r * u.ldd + g * GROUP) as *mut [f32; GROUP]) });
        }
    }
}
