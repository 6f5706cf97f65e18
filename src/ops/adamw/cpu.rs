//! AdamW on the CPU: the clip's norm (gradient health's blocks on the grads'
//! table), then one pass over the flat element range, block by block, 16
//! lanes at a time (a tensor's last partial group goes through the same
//! lanes from a zero-padded copy, so tails round like the rest). The
//! compact formats' bit work (split masters, stochastic rounding) runs on
//! each group's 16 f32 values in plain integer loops, the same on every ISA.
//! 8-bit moments go by quantization block (`cpu_q8.rs`), stepped through
//! the same `piece_step` on decoded buffers.

use super::formats::{
    join, random, salt, split, ADAMW_SR_MOMENTS, ADAMW_SR_PARAMS, STREAM_MOMENTS, STREAM_PARAMS,
};
use super::{AdamWCall, AdamWConsts, ADAMW_AMSGRAD, ADAMW_CLIP, ADAMW_FOUND_INF};
use crate::dtype::{DType, Float};
use crate::lanes::detect::Available;
use crate::lanes::{dispatch_isa, Lanes, GROUP};
use crate::ops::grad_stats::{clip_coefficient, partials_of, stats_table};
use crate::runner::Runner;
use crate::tensor_list::ListSeg;
use half::{bf16, f16};

/// The step's decision before the pass (shared with the reference model):
/// the clip coefficient, or None when the step is skipped. Writes the norm
/// to the report.
///
/// # Safety
/// `call` comes from the front end; `norm` is the grads' global norm when
/// `ADAMW_CLIP` is set (else ignored).
pub(crate) unsafe fn decide(call: &AdamWCall, norm: impl FnOnce() -> f64) -> Option<f32> {
    let o = &call.options;
    let mut coef = call.consts.clip_coef;
    let mut go = !(o.has(ADAMW_FOUND_INF) && o.found_inf != 0.0);
    let mut reported = f64::NAN;
    if o.has(ADAMW_CLIP) {
        // The unscaled gradients' norm: AMP's scale divides it out.
        let n = norm() / (call.consts.grad_scale as f64).abs();
        reported = n;
        // Finite in f64 but past f32's range is a norm that reads inf as
        // torch's float32 norm (and our grad_norm tensor): skipped too, as
        // the docs say of a non-finite norm (issue 58).
        if n.is_finite() && (n as f32).is_finite() {
            coef = clip_coefficient(n, o.max_grad_norm);
        } else {
            go = false;
        }
    }
    // SAFETY: the front end points `report` at its own result.
    unsafe {
        call.report.write(super::AdamWReport {
            grad_norm: reported,
            stepped: go as u32,
        })
    };
    go.then_some(coef)
}

/// Runs the step on the CPU.
///
/// # Safety
/// `call` was built by the front end (lists lowered, workspace checked).
pub(crate) unsafe fn cpu(call: &AdamWCall, isa: Available, runner: &dyn Runner) {
    let t = call.tiling;
    // SAFETY: the front end lowered the lists and checked the workspace.
    let coef = unsafe {
        decide(call, || {
            let g = t.grad_tiling();
            let parts = partials_of(call.workspace, &g);
            stats_table(call.grads.rows(), &g, parts, isa, runner).norm()
        })
    };
    let Some(coef) = coef else { return };
    let mut k = call.consts;
    k.clip_coef = coef;
    let ams = call.options.has(ADAMW_AMSGRAD);
    // SAFETY: forwarded.
    unsafe {
        dispatch_isa!(isa, L => dispatch_pgm!(
            call.params.dtype, call.grads.dtype, call.exp_avgs.dtype,
            run::<L>(call, &k, ams, runner)
        ))
    }
}

/// Calls `$f::<L, P, G, M>` for the validated (param, grad, moment) dtypes:
/// moments are f32 or the params' dtype, or bf16 (stochastically rounded);
/// 8-bit moments (u8) are stepped as f32 (`run` sends them to `run_q8`).
macro_rules! dispatch_pgm {
    ($p:expr, $g:expr, $m:expr, $f:ident :: <$L:ty> ($($a:expr),*)) => {
        match ($p, $m) {
            (DType::BF16, DType::BF16) => dispatch_pgm!(@g $g, $f::<$L, bf16, bf16>($($a),*)),
            (DType::BF16, _) => dispatch_pgm!(@g $g, $f::<$L, bf16, f32>($($a),*)),
            (DType::F16, DType::F16) => dispatch_pgm!(@g $g, $f::<$L, f16, f16>($($a),*)),
            (DType::F16, DType::BF16) => dispatch_pgm!(@g $g, $f::<$L, f16, bf16>($($a),*)),
            (DType::F16, _) => dispatch_pgm!(@g $g, $f::<$L, f16, f32>($($a),*)),
            (_, DType::BF16) => dispatch_pgm!(@g $g, $f::<$L, f32, bf16>($($a),*)),
            _ => dispatch_pgm!(@g $g, $f::<$L, f32, f32>($($a),*)),
        }
    };
    (@g $g:expr, $f:ident :: <$L:ty, $P:ty, $M:ty> ($($a:expr),*)) => {
        match $g {
            DType::BF16 => $f::<$L, $P, bf16, $M>($($a),*),
            DType::F16 => $f::<$L, $P, f16, $M>($($a),*),
            _ => $f::<$L, $P, f32, $M>($($a),*),
        }
    };
}
use dispatch_pgm;

/// Pointers of one piece: `n` elements of row `r` of each table, from
/// element `lo` of the tensor.
pub(super) struct Piece<P, G, M> {
    pub p: *mut P,
    pub g: *const G,
    pub m: *mut M,
    pub v: *mut M,
    pub vmax: *mut M,
    pub master: *mut f32,
    /// Split masters' low halves (instead of `master`).
    pub low: *mut i16,
    /// The key of the piece's element 0 (stochastic rounding).
    pub key: u64,
}

/// A piece's masters: the f32 masters (4-byte elements of the masters'
/// list, `ws(4)`), or with split masters the low halves (`ws(2)`); the
/// other pointer NULL.
#[inline(always)]
pub(super) fn masters(split: bool, ws: impl Fn(usize) -> *mut u8) -> (*mut f32, *mut i16) {
    if split {
        (core::ptr::null_mut(), ws(2).cast())
    } else {
        (ws(4).cast(), core::ptr::null_mut())
    }
}

unsafe fn run<L: Lanes, P: Float, G: Float, M: Float>(
    call: &AdamWCall,
    k: &AdamWConsts,
    ams: bool,
    runner: &dyn Runner,
) {
    if call.state.quantized_moments != 0 {
        // SAFETY: forwarded.
        return unsafe { super::cpu_q8::run_q8::<L, P, G>(call, k, ams, runner) };
    }
    let t = call.tiling;
    let nb = t.blocks as usize;
    // SAFETY: the front end wrote each present list's table (and the keys).
    let ([ps, gs, ms, vs, xs, ws], keys) = unsafe { (call.tables(), call.keys()) };
    let (state, step) = (call.state, call.options.step);
    let split_masters = state.split_masters != 0;
    runner.parallel_for(nb, &|b| {
        if b >= nb {
            return;
        }
        let (s, e) = t.block_range(b);
        let first = ps.partition_point(|g| g.end() <= s);
        for r in first..ps.len() {
            let row = &ps[r];
            if row.start >= e {
                break;
            }
            let lo = s.max(row.start) - row.start;
            let n = e.min(row.end()) - row.start - lo;
            let at = |l: &[ListSeg], size: usize| -> *mut u8 {
                l.get(r).map_or(core::ptr::null_mut(), |x| {
                    (x.data as *mut u8).wrapping_add(lo * size)
                })
            };
            let (master, low) = masters(split_masters, |size| at(ws, size));
            let piece = Piece::<P, G, M> {
                p: at(ps, size_of::<P>()).cast(),
                g: at(gs, size_of::<G>()).cast(),
                m: at(ms, size_of::<M>()).cast(),
                v: at(vs, size_of::<M>()).cast(),
                vmax: if ams {
                    at(xs, size_of::<M>()).cast()
                } else {
                    core::ptr::null_mut()
                },
                master,
                low,
                key: keys.get(r).map_or(0, |k| k.wrapping_add(lo as u64)),
            };
            // SAFETY: the rows describe validated, pairwise disjoint
            // tensors; this block's flat range is its own; `L` is available.
            unsafe {
                L::enter(
                    #[inline(always)]
                    || piece_step::<L, P, G, M>(&piece, n, k, &state, step),
                )
            };
        }
    });
}

use core::mem::size_of;

/// Elements ahead the loop prefetches: 256 (1 KiB of an f32 stream).
/// Seven streams at once outrun one core's hardware prefetchers; measured
/// on Zen 3 (`benches/benches/adamw.rs`, one core) 10-15% faster than none.
const PREFETCH: usize = 256;

/// `1 / s` when it is exact: `s` a power of two with a normal reciprocal.
#[inline(always)]
fn exact_inverse(s: f32) -> Option<f32> {
    let b = s.to_bits();
    let e = b >> 23;
    (b & 0x007f_ffff == 0 && (1..=253).contains(&e)).then(|| f32::from_bits((254 - e) << 23))
}

/// The lane constants.
pub(super) struct K<L> {
    step_size: L,
    bc2: L,
    b1: L,
    omb1: L,
    b2: L,
    omb2: L,
    eps: L,
    decay: L,
    /// L2 mode's weight decay; `None` when decoupled or zero (torch adds
    /// the term only then), so that `g` is not formed as `g + p * 0` (NaN
    /// for an infinite or NaN `p`, where torch's moments stay finite).
    l2: Option<L>,
    scale: L,
    /// `1 / grad_scale` when that is exact (a power of two): the division
    /// as a multiplication, the same bits (both round `g 2^-k` once).
    inv_scale: Option<L>,
    sign: L,
    coef: L,
    /// The moments' hash salt (stochastically rounded bf16 moments).
    sr_moments: Option<u32>,
    /// The params' hash salt (stochastically rounded bf16 params).
    sr_params: Option<u32>,
    /// `1 / grad_scale`, the clip's coefficient and the sign are all 1
    /// (no AMP scale, no clipping this step, minimizing), and no L2 term:
    /// the gradient's three products are skipped. The same bits: `x * 1` is
    /// `x` for every number, and a NaN gradient's payload reaches the
    /// moments alike (their own products quiet it).
    plain_grad: bool,
}

/// Steps the piece's `n` elements.
///
/// # Safety
/// Inside `L`'s context; the piece's `n` elements of each present tensor
/// are the caller's alone.
#[inline(always)]
pub(super) unsafe fn piece_step<L: Lanes, P: Float, G: Float, M: Float>(
    x: &Piece<P, G, M>,
    n: usize,
    k: &AdamWConsts,
    st: &super::AdamWState,
    step: u64,
) {
    // SAFETY: forwarded.
    unsafe { piece_step_with::<L, P, G, M>(x, n, &consts(k, st, step)) }
}

/// The step's constants as lanes (inside `L`'s context): built once for
/// many pieces where they are short (the 8-bit moments' 256-element
/// blocks).
#[inline(always)]
pub(super) fn consts<L: Lanes>(k: &AdamWConsts, st: &super::AdamWState, step: u64) -> K<L> {
    K {
        step_size: L::splat(k.step_size),
        bc2: L::splat(k.bias_correction2_sqrt),
        b1: L::splat(k.beta1),
        omb1: L::splat(k.one_minus_beta1),
        b2: L::splat(k.beta2),
        omb2: L::splat(k.one_minus_beta2),
        eps: L::splat(k.eps),
        decay: L::splat(k.decay),
        l2: if k.l2 != 0.0 {
            Some(L::splat(k.l2))
        } else {
            None
        },
        scale: L::splat(k.grad_scale),
        inv_scale: exact_inverse(k.grad_scale).map(L::splat),
        sign: L::splat(k.sign),
        coef: L::splat(k.clip_coef),
        sr_moments: (st.rounding & ADAMW_SR_MOMENTS != 0)
            .then(|| salt(st.seed, step, STREAM_MOMENTS)),
        sr_params: (st.rounding & ADAMW_SR_PARAMS != 0).then(|| salt(st.seed, step, STREAM_PARAMS)),
        plain_grad: exact_inverse(k.grad_scale) == Some(1.0)
            && k.clip_coef == 1.0
            && k.sign == 1.0
            && k.l2 == 0.0,
    }
}

/// `piece_step` with its constants built.
///
/// # Safety
/// As `piece_step`.
#[inline(always)]
pub(super) unsafe fn piece_step_with<L: Lanes, P: Float, G: Float, M: Float>(
    x: &Piece<P, G, M>,
    n: usize,
    c: &K<L>,
) {
    let full = n / GROUP * GROUP;
    // One loop per kind of master and for the plain case (`K::plain_grad`
    // and no amsgrad maximum), so that a group's instructions hold no test
    // of them: the fewer instructions and the shorter chain a group has,
    // the more groups' divisions the out-of-order window overlaps.
    // SAFETY: forwarded.
    unsafe {
        match (
            x.master.is_null(),
            x.low.is_null(),
            c.plain_grad && x.vmax.is_null(),
        ) {
            (false, _, true) => full_groups::<L, P, G, M, F32_MASTER, true>(x, full, c),
            (false, _, false) => full_groups::<L, P, G, M, F32_MASTER, false>(x, full, c),
            (true, false, true) => full_groups::<L, P, G, M, SPLIT_MASTER, true>(x, full, c),
            (true, false, false) => full_groups::<L, P, G, M, SPLIT_MASTER, false>(x, full, c),
            (true, true, true) => full_groups::<L, P, G, M, NO_MASTER, true>(x, full, c),
            (true, true, false) => full_groups::<L, P, G, M, NO_MASTER, false>(x, full, c),
        }
    }
    let rest = n - full;
    if rest == 0 {
        return;
    }
    // The tail through the same lanes, from zero-padded copies.
    let z = |_| P::from_f32(0.0);
    let mut p: [P; GROUP] = core::array::from_fn(z);
    let mut g: [G; GROUP] = core::array::from_fn(|_| G::from_f32(0.0));
    let mut m: [M; GROUP] = core::array::from_fn(|_| M::from_f32(0.0));
    let mut v = m;
    let mut vmax = m;
    let mut w = [0f32; GROUP];
    let mut low = [0i16; GROUP];
    // SAFETY: `rest` elements from `full` are this piece's.
    unsafe {
        copy_in(&mut p, x.p.add(full), rest);
        copy_in(&mut g, x.g.add(full), rest);
        copy_in(&mut m, x.m.add(full), rest);
        copy_in(&mut v, x.v.add(full), rest);
        if !x.vmax.is_null() {
            copy_in(&mut vmax, x.vmax.add(full), rest);
        }
        if !x.master.is_null() {
            copy_in(&mut w, x.master.add(full), rest);
        }
        if !x.low.is_null() {
            copy_in(&mut low, x.low.add(full), rest);
        }
    }
    group::<L, P, G, M, false>(
        c,
        &mut p,
        &g,
        &mut m,
        &mut v,
        (!x.vmax.is_null()).then_some(&mut vmax),
        master(
            (!x.master.is_null()).then_some(&mut w),
            (!x.low.is_null()).then_some(&mut low),
        ),
        x.key.wrapping_add(full as u64),
    );
    // SAFETY: as above.
    unsafe {
        copy_out(&p, x.p.add(full), rest);
        copy_out(&m, x.m.add(full), rest);
        copy_out(&v, x.v.add(full), rest);
        if !x.vmax.is_null() {
            copy_out(&vmax, x.vmax.add(full), rest);
        }
        if !x.master.is_null() {
            copy_out(&w, x.master.add(full), rest);
        }
        if !x.low.is_null() {
            copy_out(&low, x.low.add(full), rest);
        }
    }
}

/// `full_groups`' kinds of master.
const NO_MASTER: u8 = 0;
const F32_MASTER: u8 = 1;
const SPLIT_MASTER: u8 = 2;

/// The first `full` (a multiple of `GROUP`) elements of a piece whose
/// master is of kind `W` (`PLAIN`: `K::plain_grad` and no amsgrad maximum).
///
/// # Safety
/// As `piece_step_with`'s; the piece's master pointers are `W`'s.
#[inline(always)]
unsafe fn full_groups<L: Lanes, P: Float, G: Float, M: Float, const W: u8, const PLAIN: bool>(
    x: &Piece<P, G, M>,
    full: usize,
    c: &K<L>,
) {
    let mut i = 0;
    while i < full {
        // Every stream a fixed distance ahead (an address past the piece
        // is never dereferenced: a prefetch does not fault).
        let d = i + PREFETCH;
        L::prefetch(x.p.wrapping_add(d).cast());
        L::prefetch(x.g.wrapping_add(d).cast());
        L::prefetch(x.m.wrapping_add(d).cast());
        L::prefetch(x.v.wrapping_add(d).cast());
        match W {
            F32_MASTER => L::prefetch(x.master.wrapping_add(d).cast()),
            SPLIT_MASTER => L::prefetch(x.low.wrapping_add(d).cast()),
            _ => {}
        }
        // SAFETY: i + GROUP <= n elements of each present tensor are this
        // piece's; absent lists are NULL and never dereferenced.
        unsafe {
            let master = match W {
                F32_MASTER => Master::F32(&mut *x.master.add(i).cast::<[f32; GROUP]>()),
                SPLIT_MASTER => Master::Split(&mut *x.low.add(i).cast::<[i16; GROUP]>()),
                _ => Master::None,
            };
            group::<L, P, G, M, PLAIN>(
                c,
                &mut *x.p.add(i).cast::<[P; GROUP]>(),
                &*x.g.add(i).cast::<[G; GROUP]>(),
                &mut *x.m.add(i).cast::<[M; GROUP]>(),
                &mut *x.v.add(i).cast::<[M; GROUP]>(),
                if PLAIN { None } else { opt(x.vmax, i) },
                master,
                x.key.wrapping_add(i as u64),
            )
        };
        i += GROUP;
    }
}

/// Where a group's master lives.
enum Master<'a> {
    /// No master: the param is the value updated.
    None,
    /// An f32 master.
    F32(&'a mut [f32; GROUP]),
    /// A split master: the bf16 param's bits and these low halves.
    Split(&'a mut [i16; GROUP]),
}

#[inline(always)]
fn master<'a>(w: Option<&'a mut [f32; GROUP]>, low: Option<&'a mut [i16; GROUP]>) -> Master<'a> {
    match (w, low) {
        (Some(w), _) => Master::F32(w),
        (None, Some(l)) => Master::Split(l),
        (None, None) => Master::None,
    }
}

/// A group's 16-bit elements as bits (`None` for f32: never, by validation,
/// where a caller asks).
#[inline(always)]
fn bits<T: Float>(x: &mut [T; GROUP]) -> Option<&mut [u16; GROUP]> {
    bytemuck::try_cast_mut::<[T; GROUP], [u16; GROUP]>(x).ok()
}

/// Stores `v` rounded stochastically to bf16 with the random bits
/// `r[j] >> SHIFT` (16 of them), or to nearest when `dst` is not bf16
/// (never, by validation, where a caller asks).
#[inline(always)]
fn store_sr<L: Lanes, T: Float, const SHIFT: u32>(v: L, dst: &mut [T; GROUP], r: &[u32; GROUP]) {
    match bytemuck::try_cast_mut::<[T; GROUP], [bf16; GROUP]>(dst) {
        Ok(b) if T::DTYPE == DType::BF16 => v.store_bf16_sr::<SHIFT>(b, r),
        Ok(b) => T::store::<L>(v, bytemuck::cast_mut(b)),
        Err(_) => T::store::<L>(v, dst),
    }
}

/// The 32 random bits of each element of the group at `key`: `random`'s,
/// on 32-bit lanes while the group's keys share their high half (all but
/// a group straddling a multiple of 2^32).
#[inline(always)]
pub(super) fn randoms<L: Lanes>(salt: u32, key: u64) -> [u32; GROUP] {
    let lo = key as u32;
    if lo <= u32::MAX - GROUP as u32 {
        L::hash16(lo, salt ^ ((key >> 32) as u32).wrapping_mul(0x9e37_79b9))
    } else {
        let mut r = [0u32; GROUP];
        for (j, x) in r.iter_mut().enumerate() {
            *x = random(salt, key.wrapping_add(j as u64));
        }
        r
    }
}

/// `Some(&mut group at i)` of an optional tensor.
///
/// # Safety
/// Non-NULL `p` is valid for `i + GROUP` elements, this piece's alone.
#[inline(always)]
unsafe fn opt<'a, T>(p: *mut T, i: usize) -> Option<&'a mut [T; GROUP]> {
    if p.is_null() {
        None
    } else {
        // SAFETY: the caller's contract.
        Some(unsafe { &mut *p.add(i).cast::<[T; GROUP]>() })
    }
}

#[inline(always)]
unsafe fn copy_in<T: Copy>(dst: &mut [T; GROUP], src: *const T, n: usize) {
    // SAFETY: `n` readable elements at `src` (caller); n < GROUP.
    unsafe { core::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), n) }
}

#[inline(always)]
unsafe fn copy_out<T: Copy>(src: &[T; GROUP], dst: *mut T, n: usize) {
    // SAFETY: `n` writable elements at `dst` (caller); n < GROUP.
    unsafe { core::ptr::copy_nonoverlapping(src.as_ptr(), dst, n) }
}

/// One group of 16 elements: the formula of the module docs, in its order
/// (`PLAIN`: the gradient's three factors are 1, no L2 term, no amsgrad
/// maximum: the products and the tests skipped).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn group<L: Lanes, P: Float, G: Float, M: Float, const PLAIN: bool>(
    c: &K<L>,
    p: &mut [P; GROUP],
    g: &[G; GROUP],
    m: &mut [M; GROUP],
    v: &mut [M; GROUP],
    vmax: Option<&mut [M; GROUP]>,
    master: Master<'_>,
    key: u64,
) {
    let gv = if PLAIN {
        G::load::<L>(g)
    } else {
        let gv = match c.inv_scale {
            Some(r) => G::load::<L>(g).mul(r),
            None => G::load::<L>(g).div(c.scale),
        };
        gv.mul(c.coef).mul(c.sign)
    };
    let mut pv = match &master {
        Master::F32(w) => L::load(w),
        Master::Split(low) => match bits(p) {
            Some(hi) => {
                let mut w = [0f32; GROUP];
                for j in 0..GROUP {
                    w[j] = join(hi[j], low[j]);
                }
                L::load(&w)
            }
            None => P::load::<L>(p),
        },
        Master::None => P::load::<L>(p),
    };
    let gv = match c.l2 {
        Some(l2) if !PLAIN => gv.add(pv.mul(l2)),
        _ => gv,
    };
    pv = pv.mul(c.decay);
    let mv = M::load::<L>(m).mul(c.b1).add(gv.mul(c.omb1));
    let vv = M::load::<L>(v).mul(c.b2).add(gv.mul(gv).mul(c.omb2));
    // exp_avg takes the low 16 random bits, exp_avg_sq (and its maximum) the
    // high 16: one hash per element for both.
    // (A match, not Option::map: a closure may be compiled outside the ISA's
    // target features, and its integer loops then do not vectorize.)
    #[allow(clippy::manual_map)]
    let r = match c.sr_moments {
        Some(s) => Some(randoms::<L>(s, key)),
        None => None,
    };
    match &r {
        Some(r) => {
            store_sr::<L, M, 0>(mv, m, r);
            store_sr::<L, M, 16>(vv, v, r);
        }
        None => {
            M::store::<L>(mv, m);
            M::store::<L>(vv, v);
        }
    }
    let den_in = match vmax {
        Some(x) => {
            let old = M::load::<L>(x);
            // v < old ? old : v — a NaN v propagates.
            let mx = vv.select_lt(old, old, vv);
            // A kept maximum is a bf16 already: its rounding leaves it.
            match &r {
                Some(r) => store_sr::<L, M, 16>(mx, x, r),
                None => M::store::<L>(mx, x),
            }
            mx
        }
        None => vv,
    };
    let den = den_in.sqrt().div(c.bc2).add(c.eps);
    pv = pv.sub(c.step_size.mul(mv).div(den));
    match master {
        Master::F32(w) => {
            pv.store(w);
            P::store::<L>(pv, p);
        }
        Master::Split(low) => {
            let mut w = [0f32; GROUP];
            pv.store(&mut w);
            match bits(p) {
                Some(hi) => {
                    for j in 0..GROUP {
                        (hi[j], low[j]) = split(w[j]);
                    }
                }
                None => P::store::<L>(pv, p),
            }
        }
        Master::None => match c.sr_params {
            Some(s) => store_sr::<L, P, 16>(pv, p, &randoms::<L>(s, key)),
            None => P::store::<L>(pv, p),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_inverses_are_powers_of_two() {
        assert_eq!(exact_inverse(1.0), Some(1.0));
        assert_eq!(exact_inverse(65536.0), Some(1.0 / 65536.0));
        assert_eq!(exact_inverse(0.5), Some(2.0));
        assert_eq!(exact_inverse(3.0), None);
        assert_eq!(exact_inverse(f32::MAX), None);
        // 2^127: its inverse is subnormal; 2^126's is normal.
        assert_eq!(exact_inverse(f32::from_bits(0x7f00_0000)), None);
        assert_eq!(
            exact_inverse(f32::from_bits(0x7e80_0000)),
            Some(f32::from_bits(0x0080_0000))
        );
        assert_eq!(exact_inverse(f32::from_bits(0x0040_0000)), None);
        // The division and the multiplication agree on every value.
        let mut s = 0x2545_f491u32;
        for _ in 0..1_000_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let g = f32::from_bits(s);
            for d in [1.0f32, 65536.0, 2f32.powi(-20), 2f32.powi(126)] {
                let r = exact_inverse(d).unwrap_or(f32::NAN);
                assert_eq!((g * r).to_bits(), (g / d).to_bits(), "{g:e} / {d:e}");
            }
        }
    }
}
