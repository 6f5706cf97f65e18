//! Matmul on the CPU: BLIS's loops around the one microkernel. Per tile
//! (a worker's, see `plan.rs`): K slices of `kc`; per slice, b's slice
//! packed once (`kc x nc`), then per `mc` block of rows a's slice, and the
//! microkernel over A micro-panels (outer: one stays in L1) and B
//! micro-panels (inner: the packed slice streams from L2). The sums carry
//! from slice to slice in f32 (in c itself when it is f32, else in the
//! arena's partials), so each element is one chain of FMAs, k ascending.
//!
//! Tried and not kept (Zen 5, 2026-12-07): prefetching the next pack's
//! source (the next b slice, the next a block) a few lines per microkernel
//! call, for the LM head's products whose operands come from memory. The
//! packs' share of the LM head's dx stayed at 6% of its time (perf), the
//! hint L1 or L2; the time moved only with the code's layout (74-78 ms).
//! Nor a plan with `kc` 512 and `nc` 256 (K = 1024 in one slice, no
//! partials, for the LM head's forward): 3-4% slower on every shape.

use super::pack::{pack, pack_a_rows, panel_steps, Mat, KC};
use super::pairs::{pack_pairs, pack_pairs_a_rows, pairs};
use super::plan::PARTIALS_PAD;
use super::ukernel::{Micro, Tile, ARM_PAIRS, FLUSHED_CHAIN, NO_PAIRS, X86_PAIRS};
use super::*;
use crate::lanes::detect::Available;
use crate::lanes::dispatch_isa;
use crate::ops::{dispatch_xg, run_blocks};
use crate::runner::Runner;
use crate::workspace::Workspace;

/// Runs the plan on the CPU.
///
/// # Safety
/// `call` was built by `prepare` and its workspace checked by `launch`.
pub(crate) unsafe fn cpu(call: &MatmulCall, isa: Available, runner: &dyn Runner) {
    // SAFETY: forwarded from this function's contract.
    unsafe {
        dispatch_isa!(isa, L => dispatch_xg!(call.a.dtype, call.c.dtype, run::<L>(call, runner)))
    }
}

/// What every tile needs, copied into registers.
#[derive(Clone, Copy)]
struct Kern<T, O> {
    a: Mat<T>,
    b: Mat<T>,
    c: *mut O,
    trans_a: bool,
    trans_b: bool,
    accumulate: bool,
    t: MatmulTiling,
    ws: Workspace,
}

// SAFETY: the pointers are the call's tensors and workspace; tiles write
// disjoint parts of c and each worker its own arena.
unsafe impl<T, O> Sync for Kern<T, O> {}

unsafe fn run<L: Tile, T: Float, O: Float>(call: &MatmulCall, runner: &dyn Runner) {
    let t = call.tiling;
    let (m, n, k) = (t.m as usize, t.n as usize, t.k as usize);
    let c = call.c.data as *mut O;
    if k == 0 {
        // An empty sum: zeros, or c as it is.
        if call.accumulate == 0 {
            for i in 0..m * n {
                // SAFETY: c holds m x n.
                unsafe { *c.add(i) = O::from_f32(0.0) };
            }
        }
        return;
    }
    let Ok(ws) = Workspace::new(call.workspace, call.workspace_bytes, t.workspace_bytes) else {
        return;
    };
    let kern = Kern::<T, O> {
        a: Mat {
            p: call.a.data as *const T,
            ld: if call.trans_a != 0 { m } else { k },
        },
        b: Mat {
            p: call.b.data as *const T,
            ld: if call.trans_b != 0 { k } else { n },
        },
        c,
        trans_a: call.trans_a != 0,
        trans_b: call.trans_b != 0,
        accumulate: call.accumulate != 0,
        t,
        ws,
    };
    let kp = &kern;
    let bf16 = T::DTYPE == crate::dtype::DType::BF16;
    if call.math == MatmulMath::Bf16Dot as u32 && bf16 {
        run_blocks!(plain runner, t.flags, t.blocks, |w| worker_dot::<L, T, O>(kp, w))
    } else if call.math == MatmulMath::Bf16DotArm as u32 && bf16 {
        run_blocks!(plain runner, t.flags, t.blocks, |w| worker_arm::<L, T, O>(kp, w))
    } else {
        run_blocks!(plain runner, t.flags, t.blocks, |w| worker::<L, T, O>(kp, w))
    }
}

/// `tiles` with the FMA chain.
///
/// # Safety
/// As `tiles`.
#[inline(always)]
unsafe fn worker<L: Tile, T: Float, O: Float>(k: &Kern<T, O>, w: usize) {
    // SAFETY: forwarded.
    unsafe { tiles::<L, T, O, false, false>(k, w) }
}

/// `tiles` with the bf16 pair dot.
///
/// # Safety
/// As `tiles`.
#[inline(always)]
unsafe fn worker_dot<L: Tile, T: Float, O: Float>(k: &Kern<T, O>, w: usize) {
    // SAFETY: forwarded.
    unsafe { tiles::<L, T, O, true, false>(k, w) }
}

/// `tiles` with Arm's bf16 pair dot.
///
/// # Safety
/// As `tiles`.
#[inline(always)]
unsafe fn worker_arm<L: Tile, T: Float, O: Float>(k: &Kern<T, O>, w: usize) {
    // SAFETY: forwarded.
    unsafe { tiles::<L, T, O, false, true>(k, w) }
}

/// Worker `w`'s tiles, `w, w + blocks, ...` (`DOT`: VDPBF16PS's pair dot;
/// `ARM`: Arm's).
///
/// # Safety
/// Inside `L::enter`; the call's contract.
#[inline(always)]
unsafe fn tiles<L: Tile, T: Float, O: Float, const DOT: bool, const ARM: bool>(
    k: &Kern<T, O>,
    w: usize,
) {
    let k = &{ *k };
    let t = &k.t;
    // SAFETY: worker w's arena, inside the checked workspace, used by it
    // alone.
    let arena = unsafe {
        k.ws.region(w * t.arena_bytes as usize, t.arena_bytes as usize / 4)
            .as_mut_ptr()
    };
    let mut tile = w;
    // The columns whose packed b slice the arena holds (K in one slice).
    let mut packed = None;
    while tile < t.tiles() {
        // SAFETY: the tile is inside c; the arena is this worker's.
        unsafe { one_tile::<L, T, O, DOT, ARM>(k, tile, arena, &mut packed) };
        tile += t.blocks as usize;
    }
}

/// One output tile, all of K. `packed`: the columns of the b slice the
/// arena holds from this worker's last tile, when that was all of K.
///
/// # Safety
/// As `worker`; `arena` holds `t.arena_bytes`.
#[inline(always)]
unsafe fn one_tile<L: Tile, T: Float, O: Float, const DOT: bool, const ARM: bool>(
    k: &Kern<T, O>,
    tile: usize,
    arena: *mut f32,
    packed: &mut Option<(usize, usize)>,
) {
    // Pair panels: VDPBF16PS's pair dot in hardware, or Arm's (in hardware
    // or by the model); else the chain's panels (VDPBF16PS's as the
    // flushed chain under DOT).
    let hw = DOT && L::PAIRS || ARM;
    let t = &k.t;
    let (r0, r1, c0, c1) = t.tile(tile);
    let (kk, kc, mc, nc) = (t.k as usize, t.kc as usize, t.mc as usize, t.nc as usize);
    // Pair panels hold a step pair per f32 slot: slices of two plan slices
    // fill the same arena, and the partials make half the round trips.
    let kc = if hw { 2 * kc } else { kc };
    // The partials' row stride: nc plus a line, so that the rows of a
    // block do not share L1 sets (a 2 KiB stride put 14 rows in two).
    let ldp = nc + PARTIALS_PAD;
    let (mr, nr) = (L::MR, L::NR);
    // SAFETY: the arena's regions (plan.rs).
    let (ap, bp, cp) = unsafe {
        (
            arena,
            arena.add(t.b_offset as usize / 4),
            arena.add(t.c_offset as usize / 4),
        )
    };
    let ldc = t.n as usize;
    let partials = t.c_partials != 0;
    let mut p0 = 0;
    while p0 < kk {
        let ks = kc.min(kk - p0);
        let (first, last) = (p0 == 0, p0 + ks == kk);
        // The panels' steps: pairs, or the chain's (an even count for DOT).
        let sp = if hw {
            pairs(ks)
        } else {
            panel_steps::<DOT>(ks)
        };
        // K in one slice: b's slice is the same for every tile down a
        // column (a weight gradient's, K the tokens), packed once.
        let whole = first && last;
        if !(whole && *packed == Some((c0, c1))) {
            // SAFETY: b's slice is inside b; bp holds kc x nc.
            unsafe {
                if hw {
                    pack_pairs::<L, T>(k.b, !k.trans_b, c0, c1 - c0, p0, ks, nr, bp)
                } else {
                    pack::<L, T, DOT>(k.b, !k.trans_b, c0, c1 - c0, p0, ks, nr, bp)
                }
            };
        }
        *packed = if whole { Some((c0, c1)) } else { None };
        let mut i0 = r0;
        while i0 < r1 {
            let rows = mc.min(r1 - i0);
            // a stored [K, M] packs step-major ([k][MR]), a stored [M, K]
            // row-major ([MR][KC]): either is a straight copy, no transpose.
            // SAFETY: a's block is inside a; ap holds mc x kc.
            unsafe {
                match (k.trans_a, hw) {
                    (true, true) => pack_pairs::<L, T>(k.a, true, i0, rows, p0, ks, mr, ap),
                    (true, false) => pack::<L, T, DOT>(k.a, true, i0, rows, p0, ks, mr, ap),
                    (false, true) => pack_pairs_a_rows(k.a, i0, rows, p0, ks, mr, ap),
                    (false, false) => pack_a_rows::<L, T, DOT>(k.a, i0, rows, p0, ks, mr, ap),
                }
            };
            let a_stride = if k.trans_a { sp } else { KC };
            for ir in (0..rows).step_by(mr) {
                let i = i0 + ir;
                for jr in (0..c1 - c0).step_by(nr) {
                    let j = c0 + jr;
                    // The sums so far: c's own value (accumulate), the last
                    // slice's (in c when f32, else in the partials), or none.
                    let (ci, cj) = (i - r0, j - c0);
                    // SAFETY: every pointer below is inside its buffer: c
                    // (i, j), the partials (ci, cj) of the mt x nc tile.
                    let (init, ldi) = unsafe {
                        if first && !k.accumulate {
                            (core::ptr::null(), 0)
                        } else if partials && !first {
                            (cp.add(ci * ldp + cj) as *const f32, ldp)
                        } else {
                            (k.c.add(i * ldc + j) as *const f32, ldc)
                        }
                    };
                    // SAFETY: the panels just packed.
                    let (a, b) = unsafe { (ap.add(ir * a_stride), bp.add(jr * sp)) };
                    let (rows, cols) = (mr.min(r1 - i), nr.min(c1 - j));
                    if last {
                        let u = Micro::<O> {
                            kc: sp,
                            a,
                            b,
                            init,
                            ldi,
                            // SAFETY: inside c.
                            dst: unsafe { k.c.add(i * ldc + j) },
                            ldd: ldc,
                            rows,
                            cols,
                        };
                        // SAFETY: inside L's context; the block's buffers.
                        unsafe { micro::<L, O, DOT, ARM>(&u, k.trans_a) };
                    } else {
                        // A slice before the last: f32 sums, in the partials
                        // (16-bit c) or in c (f32 c: O is f32).
                        let (dst, ldd) = if partials {
                            // SAFETY: inside the partials.
                            (unsafe { cp.add(ci * ldp + cj) }, ldp)
                        } else {
                            // SAFETY: inside c.
                            (unsafe { k.c.add(i * ldc + j) } as *mut f32, ldc)
                        };
                        let u = Micro::<f32> {
                            kc: sp,
                            a,
                            b,
                            init,
                            ldi,
                            dst,
                            ldd,
                            rows,
                            cols,
                        };
                        // SAFETY: as above.
                        unsafe { micro::<L, f32, DOT, ARM>(&u, k.trans_a) };
                    }
                }
            }
            i0 += rows;
        }
        p0 += ks;
    }
}

/// The microkernel for A packed step-major (`trans_a`) or by rows; `DOT`:
/// VDPBF16PS's pair dot, in hardware on `PAIRS` lanes, else the flushed
/// chain: on `FLUSHING_FMA` lanes (x86 without AVX512-BF16) each FMA
/// flushed by the hardware (MXCSR's FTZ and DAZ, which the microkernel
/// enters: x86 detects tininess after rounding, as VDPBF16PS does;
/// tests/matmul_dot.rs checks the bits next to 2^-126 on every ISA), a
/// sixth of the work of `ukernel`'s `ftz_fma`, which the other lanes run;
/// `ARM`: Arm's pair dot.
///
/// # Safety
/// As `Tile::micro`.
#[inline(always)]
unsafe fn micro<L: Tile, D: Float, const DOT: bool, const ARM: bool>(u: &Micro<D>, trans_a: bool) {
    // SAFETY: forwarded.
    unsafe {
        match (trans_a, ARM, DOT && L::PAIRS, DOT && L::FLUSHING_FMA) {
            (true, true, ..) => L::micro::<D, false, false, ARM_PAIRS>(u),
            (false, true, ..) => L::micro::<D, true, false, ARM_PAIRS>(u),
            (true, false, true, _) => L::micro::<D, false, false, X86_PAIRS>(u),
            (false, false, true, _) => L::micro::<D, true, false, X86_PAIRS>(u),
            (true, false, false, true) => L::micro::<D, false, false, FLUSHED_CHAIN>(u),
            (false, false, false, true) => L::micro::<D, true, false, FLUSHED_CHAIN>(u),
            (true, ..) => L::micro::<D, false, DOT, NO_PAIRS>(u),
            (false, ..) => L::micro::<D, true, DOT, NO_PAIRS>(u),
        }
    }
}
