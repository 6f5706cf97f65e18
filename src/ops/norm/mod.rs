//! What the three RMSNorm operators share: the x/gamma shape rule, the options,
//! and the CPU kernel's CopyIn / CopyOut helpers.

pub(crate) mod forward;

use crate::dtype::{gamma_dtype_ok, DType, Float};
use crate::error::{dtype_err, invalid_fmt, Result};
use crate::lanes::{Lanes, GROUP};
use crate::tensor::{Checked, RawTensor};
use crate::workspace::{Dst, Src};

/// How the forward output is rounded. Values are the C ABI's `npk_rounding`.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Rounding {
    /// `y = round(x * rstd * (gamma + offset))`: one rounding (CANN, torch's
    /// composite `rms_norm`).
    #[default]
    Fused = 0,
    /// `y = round(round(x * rstd) * (gamma + offset))`: Hugging Face's
    /// `LlamaRMSNorm` bit pattern.
    CastBeforeGamma = 1,
}

/// Options of RmsNorm and AddRmsNorm (`npk_rms_norm_options`; the C ABI's
/// `double eps` is converted to this f32 with the same checks).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNormOptions {
    /// Added (as this f32) to the mean square; finite and >= 0. Default 1e-6.
    pub eps: f32,
    /// Added to gamma (1.0 for Gemma's zero-centred weights); finite.
    /// Default 0.0.
    pub gamma_offset: f32,
    /// Where y is rounded. Default `Fused`.
    pub rounding: Rounding,
}

impl Default for RmsNormOptions {
    fn default() -> Self {
        RmsNormOptions {
            eps: 1e-6,
            gamma_offset: 0.0,
            rounding: Rounding::Fused,
        }
    }
}

impl RmsNormOptions {
    /// Checks eps (finite, >= 0) and gamma_offset (finite); returns eps.
    pub(crate) fn eps_f32(&self) -> Result<f32> {
        let e = self.eps;
        if !(e.is_finite() && e >= 0.0) {
            return Err(invalid_fmt!("eps", "{e} is not finite and >= 0"));
        }
        if !self.gamma_offset.is_finite() {
            return Err(invalid_fmt!(
                "gamma_offset",
                "{} is not finite",
                self.gamma_offset
            ));
        }
        Ok(e)
    }
}

/// Rows and row length of a normalization.
#[derive(Clone, Copy, Debug)]
pub(crate) struct NormDims {
    pub rows: usize,
    pub cols: usize,
}

/// Checks x (float) and gamma (x's dtype or f32, the trailing dims of x).
pub(crate) fn norm_dims(
    x: &RawTensor,
    xc: &Checked,
    gamma: &RawTensor,
    gc: &Checked,
    xname: &'static str,
) -> Result<NormDims> {
    if !x.dtype.is_float() {
        return Err(dtype_err!(
            xname,
            "dtype {} is not f32, f16 or bf16",
            x.dtype
        ));
    }
    if !gamma_dtype_ok(x.dtype, gamma.dtype) {
        return Err(dtype_err!(
            "gamma",
            "dtype {} is neither {xname}'s ({}) nor f32",
            gamma.dtype,
            x.dtype
        ));
    }
    let xd = xc.shape.dims();
    let gd = gc.shape.dims();
    if gd.len() > xd.len() || xd[xd.len() - gd.len()..] != *gd {
        return Err(invalid_fmt!(
            "gamma",
            "shape {} is not the trailing dims of {xname} {}",
            gc.shape,
            xc.shape
        ));
    }
    let cols = gc.numel;
    let rows = xd[..xd.len() - gd.len()].iter().product::<usize>();
    Ok(NormDims { rows, cols })
}

/// Checks that `t` has exactly `like`'s shape and the given dtype.
pub(crate) fn same_shape(
    t: &RawTensor,
    tc: &Checked,
    like: &Checked,
    dtype: DType,
    name: &'static str,
) -> Result<()> {
    if t.dtype != dtype {
        return Err(dtype_err!(
            name,
            "dtype {} differs from {}'s {}",
            t.dtype,
            like.name,
            dtype
        ));
    }
    if tc.shape != like.shape {
        return Err(invalid_fmt!(
            name,
            "shape {} differs from {}'s {}",
            tc.shape,
            like.name,
            like.shape
        ));
    }
    Ok(())
}

/// Checks an f32 per-row tensor (rstd): any shape with `rows` elements.
pub(crate) fn rstd_check(t: &RawTensor, tc: &Checked, rows: usize) -> Result<()> {
    if t.dtype != DType::F32 {
        return Err(dtype_err!("rstd", "dtype {} is not f32", t.dtype));
    }
    if tc.numel != rows {
        return Err(invalid_fmt!(
            "rstd",
            "{} elements (shape {}) for {rows} rows",
            tc.numel,
            tc.shape
        ));
    }
    Ok(())
}

/// Stores the first `dst.len()` (< 16) lanes of `v` into `dst`: the last,
/// partial group of a row. (A value, not a closure: kernels run inside a
/// `#[target_feature]` context and must not depend on closure inlining.)
#[inline(always)]
pub(crate) fn store_tail<L: Lanes, T: Float>(dst: &mut [T], v: L) {
    let mut tmp = [T::from_f32(0.0); GROUP];
    T::store(v, &mut tmp);
    let n = dst.len().min(GROUP);
    dst[..n].copy_from_slice(&tmp[..n]);
}

/// Loads group `i` of `src` widened (the last partial group zero-padded).
#[inline(always)]
pub(crate) fn load_group<L: Lanes, T: Float>(src: &[T], i: usize) -> L {
    let start = i * GROUP;
    match src.get(start..start + GROUP) {
        Some(s) => {
            let (g, _) = s.as_chunks::<GROUP>();
            T::load(&g[0])
        }
        None => {
            let mut tmp = [T::from_f32(0.0); GROUP];
            let rest = src.get(start..).unwrap_or(&[]);
            tmp[..rest.len()].copy_from_slice(rest);
            T::load(&tmp)
        }
    }
}

/// `v` with lanes `n..16` set to +0.0. A partial group's padding lanes must
/// add nothing to a row sum, and a product with a padding zero is not zero
/// when the other factor is infinite (0 * Inf = NaN): sums mask them out, so
/// results never depend on `N mod 16`.
#[inline(always)]
pub(crate) fn first_lanes<L: Lanes>(v: L, n: usize) -> L {
    let mut t = [0f32; GROUP];
    v.store(&mut t);
    for x in t.iter_mut().skip(n) {
        *x = 0.0;
    }
    L::load(&t)
}

/// Elements `at..at + len` of `src` (`len <= 16`) widened, zero-padded to a
/// group; a whole group is one load.
///
/// # Safety
/// The range is inside `src`'s tensor and not being written.
#[inline(always)]
pub(crate) unsafe fn load_at<L: Lanes, T: Float>(src: Src<T>, at: usize, len: usize) -> L {
    if len == GROUP {
        // SAFETY: forwarded from the caller.
        return T::load(unsafe { src.group(at) });
    }
    // SAFETY: forwarded from the caller.
    load_group::<L, T>(unsafe { src.get(at, len) }, 0)
}

/// `gamma + offset` at columns `j..j + len` (`len <= 16`); the lanes past
/// `len` are exactly +0.0, so sums over padding add nothing.
///
/// # Safety
/// The columns are inside gamma.
#[inline(always)]
pub(crate) unsafe fn gamma_at<L: Lanes, G: Float>(
    gamma: Src<G>,
    j: usize,
    len: usize,
    off: L,
) -> L {
    if len == GROUP {
        // SAFETY: forwarded from the caller.
        return G::load::<L>(unsafe { gamma.group(j) }).add(off);
    }
    let mut tmp = [0f32; GROUP];
    // SAFETY: forwarded from the caller.
    load_group::<L, G>(unsafe { gamma.get(j, len) }, 0)
        .add(off)
        .store(&mut tmp);
    tmp[len.min(GROUP)..].fill(0.0);
    L::load(&tmp)
}

/// Stores `v` at `dst[at..at + len]` (`len <= 16`): a whole group with one
/// store, a partial one through a temporary.
///
/// # Safety
/// The range is inside `dst`'s tensor, and nothing else refers to it.
#[inline(always)]
pub(crate) unsafe fn store_at<L: Lanes, T: Float>(v: L, dst: Dst<T>, at: usize, len: usize) {
    if len == GROUP {
        // SAFETY: forwarded from the caller.
        T::store(v, unsafe { dst.group(at) });
    } else {
        // SAFETY: forwarded from the caller.
        store_tail::<L, T>(unsafe { dst.get(at, len) }, v);
    }
}

/// Stores groups `lo` and `hi` at `at..at + 32` of `dst`: with `STREAM`,
/// as streaming stores of whole 64-byte lines where `dst` is aligned for
/// them (ordinary stores elsewhere); the same bits either way.
///
/// # Safety
/// As for `store_at` with 32 elements.
#[inline(always)]
pub(crate) unsafe fn put_pair<L: Lanes, T: Float, const STREAM: bool>(
    dst: Dst<T>,
    at: usize,
    lo: L,
    hi: L,
) {
    // SAFETY: forwarded from the caller.
    T::put2::<L, STREAM>(lo, hi, unsafe { dst.pair(at) })
}

/// Elements `at..at + 32` of `src` widened, in `T`'s line order on `L`
/// (`LaneElem::load_line`): elementwise passes only.
///
/// # Safety
/// The range is inside `src`'s tensor and not being written.
#[inline(always)]
pub(crate) unsafe fn load_line<L: Lanes, T: Float>(src: Src<T>, at: usize) -> (L, L) {
    // SAFETY: forwarded from the caller.
    T::load_line(unsafe { src.pair(at) })
}

/// `gamma + offset` at columns `j..j + 32`, in `G`'s line order on `L`.
///
/// # Safety
/// The columns are inside gamma.
#[inline(always)]
pub(crate) unsafe fn gamma_line<L: Lanes, G: Float>(gamma: Src<G>, j: usize, off: L) -> (L, L) {
    // SAFETY: forwarded from the caller.
    let (a, b) = unsafe { load_line::<L, G>(gamma, j) };
    (a.add(off), b.add(off))
}

/// Stores `lo`, `hi` (in `T`'s line order on `L`) at `at..at + 32` of
/// `dst`, streamed with `STREAM` as `put_pair`.
///
/// # Safety
/// As for `store_at` with 32 elements.
#[inline(always)]
pub(crate) unsafe fn put_line<L: Lanes, T: Float, const STREAM: bool>(
    dst: Dst<T>,
    at: usize,
    lo: L,
    hi: L,
) {
    // SAFETY: forwarded from the caller.
    T::put_line::<L, STREAM>(lo, hi, unsafe { dst.pair(at) })
}

/// Whether an elementwise pass over `T` data with a `G` operand can work in
/// line order: the two types' line orders on `L` agree (else it loads
/// groups in order).
#[inline(always)]
pub(crate) fn lines_agree<L: Lanes, T: Float, G: Float>() -> bool {
    T::line_in_order::<L>() == G::line_in_order::<L>()
}

/// Whether a row's pass 2 carries the next row's pass 1 (`fused_row!`) for
/// data of type `T`, or the two passes run one after the other with pass 2
/// prefetching the next row. Both give the same bits. Measured on a Zen 5
/// (docs/architecture.md, "Measured choices"): carrying pays for 16-bit data, whose widening
/// and rounding make pass 2 long enough to hide the next row's sum under;
/// for f32 the separate passes were faster (RmsNormGrad f32 1.48-1.66 ->
/// 1.23-1.30 of a copy, RmsNorm and AddRmsNorm f32 ~0.1 less): a whole row
/// prefetched ahead and pass 1 from cache beat two rows interleaved in L1.
#[inline(always)]
pub(crate) const fn fuse_rows<T>() -> bool {
    core::mem::size_of::<T>() == 2
}

/// Hints that elements `at..at + 32` of `src` will be read soon: the next
/// row's, while this row is computed from cache (one 64-byte line of 16-bit
/// elements, two of f32). `at` may be past the tensor.
#[inline(always)]
pub(crate) fn prefetch_pair<L: Lanes, T>(src: Src<T>, at: usize) {
    L::prefetch(src.addr(at));
    if core::mem::size_of::<T>() > 2 {
        L::prefetch(src.addr(at + GROUP));
    }
}

/// Walks the windows of an elementwise row pass over `$n` elements: a head
/// of `$head` elements (which aligns the output to 64-byte lines for
/// streaming stores) in windows of at most 16, then pairs of whole groups
/// (`$pair` with `$p`, the pair's first column), then the rest in windows of
/// at most 16 (`$one` with `($j, $len)`). Elementwise outputs may use any
/// windows; reductions must not (their groups start at the row's start). A
/// macro so the bodies inline into the ISA context.
macro_rules! for_lines {
    ($n:expr, $head:expr, |$j:ident, $len:ident| $one:expr, |$p:ident| $pair:expr) => {{
        const G: usize = $crate::lanes::GROUP;
        let n: usize = $n;
        let head: usize = $head;
        let mut at = 0usize;
        $crate::ops::norm::groups_to!(at, head, |$j, $len| $one);
        while at + 2 * G <= n {
            let $p = at;
            $pair;
            at += 2 * G;
        }
        $crate::ops::norm::groups_to!(at, n, |$j, $len| $one);
    }};
}
pub(crate) use for_lines;

/// `for_lines`' head and tail: `$one` on groups of at most 16 from `$at`
/// up to `$end`, advancing `$at`.
macro_rules! groups_to {
    ($at:ident, $end:expr, |$j:ident, $len:ident| $one:expr) => {
        while $at < $end {
            let ($j, $len) = ($at, ($end - $at).min($crate::lanes::GROUP));
            $one;
            $at += $len;
        }
    };
}
pub(crate) use groups_to;

/// `for_lines` with the pairs software pipelined: `$stage` (loads and the
/// first half of the arithmetic, e.g. an exp's range reduction) of the
/// pair at `$p` runs beside `$pair` (the rest, with the stage's value `$s`)
/// of the pair before it, so the out-of-order window holds independent work
/// and not one pair's long dependency chains. The same operations on the
/// same values as unpipelined: the same bits.
macro_rules! for_lines_piped {
    ($n:expr, $head:expr, |$j:ident, $len:ident| $one:expr,
     |$p:ident| $stage:expr, |$q:ident, $s:ident| $pair:expr) => {{
        const G: usize = $crate::lanes::GROUP;
        let n: usize = $n;
        let head: usize = $head;
        let mut at = 0usize;
        $crate::ops::norm::groups_to!(at, head, |$j, $len| $one);
        if at + 2 * G <= n {
            let mut staged = {
                let $p = at;
                $stage
            };
            loop {
                let next = at + 2 * G;
                let more = next + 2 * G <= n;
                let ahead = if more {
                    let $p = next;
                    $stage
                } else {
                    staged
                };
                {
                    let ($q, $s) = (at, staged);
                    $pair;
                }
                staged = ahead;
                at = next;
                if !more {
                    break;
                }
            }
        }
        $crate::ops::norm::groups_to!(at, n, |$j, $len| $one);
    }};
}
pub(crate) use for_lines_piped;

/// Rounds every lane to `T` and widens it back (identity for f32).
#[inline(always)]
pub(crate) fn round_to<L: Lanes, T: Float>(v: L) -> L {
    T::round(v)
}

/// Group `i` of an f32 arena row (always a whole group: rows are padded).
#[inline(always)]
pub(crate) fn arena_group<L: Lanes>(row: &[f32], i: usize) -> L {
    let (g, _) = row.as_chunks::<GROUP>();
    match g.get(i) {
        Some(a) => L::load(a),
        None => L::splat(0.0),
    }
}
