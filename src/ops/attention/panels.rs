//! Attention's products on the matmul's microkernel: its A and B panels
//! packed from the call's tensors (widened to f32) and from a block's f32
//! scores, and `c = [c +] A B` over row groups, cut per group on a causal
//! block's diagonal.

use super::*;
use crate::lanes::GROUP;
use crate::ops::matmul::ukernel::{Micro, Tile};

/// Sixteen rows (the first `live` real, the rest zero) by `steps` steps,
/// transposed into a panel: step `k`'s lanes (one per row) at `out(k)`.
/// Sixteen steps at a time through a 16 x 16 transpose, each step's 16
/// lanes stored whole (past a `width` < 16 they spill into the step
/// written next, or into the buffer's slack); the steps past the last 16
/// element by element, `width` lanes each. `load(r, k0)`: row `r`'s 16
/// steps from `k0`, widened; `elem(r, k)`: one.
///
/// # Safety
/// Inside `L::enter`; `out(k)` is writable for 16 f32 (steps in sets of
/// 16) or `width` (the rest); `load` and `elem` are called for live rows
/// and steps inside `0..steps` only.
#[inline(always)]
unsafe fn transposed<L: Tile>(
    live: usize,
    steps: usize,
    width: usize,
    load: impl Fn(usize, usize) -> L,
    elem: impl Fn(usize, usize) -> f32,
    out: impl Fn(usize) -> *mut f32,
) {
    let full = steps / GROUP * GROUP;
    for k0 in (0..full).step_by(GROUP) {
        let m: [L; GROUP] =
            core::array::from_fn(|r| if r < live { load(r, k0) } else { L::splat(0.0) });
        for (t, v) in L::transpose16(&m).iter().enumerate() {
            // SAFETY: step k0 + t's 16 lanes (the contract).
            v.store(unsafe { &mut *(out(k0 + t) as *mut [f32; GROUP]) });
        }
    }
    for k in full..steps {
        let o = out(k);
        for r in 0..width {
            // SAFETY: step k's `width` lanes (the contract).
            unsafe { *o.add(r) = if r < live { elem(r, k) } else { 0.0 } };
        }
    }
}

/// B panels of `x^T` for `n` rows of `d` (`x` row `j` at `row(j)`): panel
/// `c` (columns `c NR ..`) holds `d` steps of NR, rows past `n` zero;
/// `transposed` sixteen rows at a time (NR is a multiple of 16: no spill).
///
/// # Safety
/// Inside `L::enter`; the rows hold `d` elements; `dst` holds
/// `d * round_up(n, NR)`.
#[inline(always)]
pub(super) unsafe fn pack_bt<L: Tile, T: Float>(
    row: impl Fn(usize) -> *const T,
    n: usize,
    d: usize,
    dst: *mut f32,
) {
    let nr = L::NR;
    for c0 in (0..n).step_by(nr) {
        for k0 in (c0..c0 + nr).step_by(GROUP) {
            let live = n.saturating_sub(k0).min(GROUP);
            // Rows past n read row 0 (never loaded): no pointer leaves x.
            let src: [*const T; GROUP] =
                core::array::from_fn(|r| row(if r < live { k0 + r } else { 0 }));
            // SAFETY: rows k0 + r < n, steps < d; step t's 16 columns from
            // k0 of panel c0 / nr.
            unsafe {
                transposed::<L>(
                    live,
                    d,
                    GROUP,
                    #[inline(always)]
                    |r, d0| T::load::<L>(&*(src[r].add(d0) as *const [T; GROUP])),
                    #[inline(always)]
                    |r, t| (*src[r].add(t)).to_f32(),
                    #[inline(always)]
                    |t| dst.add(c0 * d + t * nr + k0 - c0),
                )
            };
        }
    }
}

/// B panels of `x` (steps: its `n` rows; columns: its `d`): panel `c`
/// (columns `c NR ..`, zero past `d`) at `c * pstride`. A step's columns
/// are a row's: copied (widened) 16 at a time.
///
/// # Safety
/// Inside `L::enter`; the rows hold `d` elements; `dst` holds
/// `round_up(d, NR) / NR` panels of `pstride >= n NR`.
#[inline(always)]
pub(super) unsafe fn pack_b<L: Tile, T: Float>(
    row: impl Fn(usize) -> *const T,
    n: usize,
    d: usize,
    pstride: usize,
    dst: *mut f32,
) {
    let nr = L::NR;
    let width = d.div_ceil(nr) * nr;
    for j in 0..n {
        let r = row(j);
        for c0 in (0..width).step_by(GROUP) {
            // SAFETY: step j of panel c0 / nr, its 16 columns from c0 % nr.
            let p = unsafe {
                &mut *(dst.add((c0 / nr) * pstride + j * nr + c0 % nr) as *mut [f32; GROUP])
            };
            if c0 + GROUP <= d {
                // SAFETY: columns c0..c0 + 16 of the row.
                T::load::<L>(unsafe { &*(r.add(c0) as *const [T; GROUP]) }).store(p);
                continue;
            }
            for (cc, o) in p.iter_mut().enumerate() {
                *o = if c0 + cc < d {
                    // SAFETY: c0 + cc < d inside the row.
                    unsafe { *r.add(c0 + cc) }.to_f32()
                } else {
                    0.0
                };
            }
        }
    }
}

/// A panels of `rows` rows of `d` (steps: d): group `g` (rows `g MR ..`,
/// zero past `rows`) at `g * d * MR`, `transposed` (spilling past MR).
///
/// # Safety
/// Inside `L::enter`; the rows hold `d` elements; `dst` holds
/// `round_up(rows, MR) * d + 16`.
#[inline(always)]
pub(super) unsafe fn pack_a<L: Tile, T: Float>(
    row: impl Fn(usize) -> *const T,
    rows: usize,
    d: usize,
    dst: *mut f32,
) {
    let mr = L::MR;
    for g0 in (0..rows).step_by(mr) {
        let n = mr.min(rows - g0);
        let src: [*const T; GROUP] = core::array::from_fn(|r| row(g0 + r.min(n - 1)));
        // SAFETY: rows g0 + r < rows, steps < d; group g0 / mr's steps.
        unsafe {
            transposed::<L>(
                n,
                d,
                mr,
                #[inline(always)]
                |r, d0| T::load::<L>(&*(src[r].add(d0) as *const [T; GROUP])),
                #[inline(always)]
                |r, t| (*src[r].add(t)).to_f32(),
                #[inline(always)]
                |t| dst.add(g0 * d + t * mr),
            )
        };
    }
}

/// A panels (rows: the block's `rows`, steps: columns `0..steps`) of the f32
/// block `s` (row stride `ld`): group `g` at `g * steps * MR`, holding its
/// `group_steps` (`diag`), `transposed` (spilling past MR: into the next
/// step, or past the group into the next group or the buffer's 16 f32 of
/// slack).
///
/// # Safety
/// Inside `L::enter`; `s` holds the rows' steps (rows readable 16 past
/// `steps`); `dst` holds `round_up(rows, MR) * steps + 16`.
#[inline(always)]
pub(super) unsafe fn pack_a_f32<L: Tile>(
    s: *const f32,
    ld: usize,
    rows: usize,
    steps: usize,
    diag: Diag,
    dst: *mut f32,
) {
    let mr = L::MR;
    for g0 in (0..rows).step_by(mr) {
        // The group's stride is `steps`, whatever it holds.
        let p = dst.wrapping_add(g0 * steps);
        let row = |r: usize| s.wrapping_add((g0 + r) * ld);
        // SAFETY: rows g0 + r < rows, columns < the group's steps; the
        // group's panel.
        unsafe {
            transposed::<L>(
                mr.min(rows - g0),
                group_steps(diag, steps, g0),
                mr,
                #[inline(always)]
                |r, j0| L::load(&*(row(r).add(j0) as *const [f32; GROUP])),
                #[inline(always)]
                |r, j| *row(r).add(j),
                #[inline(always)]
                |j| p.add(j * mr),
            )
        };
    }
}

/// A panels of `s^T` (rows: columns `0..keys` of `s`, steps: its `rows`
/// rows): group `g` (keys `g MR ..`, zero past `keys`) at `g * rows * MR`.
/// A step is MR consecutive f32 of a row of `s`: stored 16 at a time, the
/// lanes past MR spilling as in `pack_a_f32`.
///
/// # Safety
/// Inside `L::enter`; `s` holds the rows' keys (readable 16 past `keys`);
/// `dst` holds `round_up(keys, MR) * rows + 16`.
#[inline(always)]
pub(super) unsafe fn pack_at_f32<L: Tile>(
    s: *const f32,
    ld: usize,
    rows: usize,
    keys: usize,
    dst: *mut f32,
) {
    let mr = L::MR;
    for g0 in (0..keys).step_by(mr) {
        // SAFETY: group g0 / mr.
        let p = unsafe { dst.add(g0 * rows) };
        let n = mr.min(keys - g0);
        for i in 0..rows {
            if n == mr {
                // SAFETY: 16 f32 of row i from key g0 (inside the row's
                // slack); step i of the group, spilling into step i + 1.
                unsafe {
                    L::load(&*(s.add(i * ld + g0) as *const [f32; GROUP]))
                        .store(&mut *(p.add(i * mr) as *mut [f32; GROUP]))
                };
                continue;
            }
            for jj in 0..mr {
                // SAFETY: as the contract.
                unsafe {
                    *p.add(i * mr + jj) = if jj < n {
                        *s.add(i * ld + g0 + jj)
                    } else {
                        0.0
                    }
                };
            }
        }
    }
}

/// How a causal block's row groups limit a product over its keys (`i0`:
/// the block's first row, so row `i0 + r` sees keys `..= i0 + r`).
#[derive(Clone, Copy)]
pub(super) enum Diag {
    /// Every row group takes all of it.
    No,
    /// Columns are keys: a row group's stop after its last row's keys.
    Cols(usize),
    /// Steps are keys: a row group's stop before its first row (the keys
    /// all its rows see; each row's diagonal is added after).
    Steps(usize),
}

/// The keys every row of the group at block row `g0` sees: `..min(steps,
/// i0 + g0)` under `Diag::Steps`, else `steps`.
#[inline(always)]
pub(super) fn group_steps(diag: Diag, steps: usize, g0: usize) -> usize {
    match diag {
        Diag::Steps(i0) => steps.min(i0 + g0),
        _ => steps,
    }
}

/// `c = [c +] A B` over the microkernel: A panels of `rows` rows and `steps`
/// steps (`pack_a*`), B panels of `cols` columns, panel stride `pstride`;
/// c f32 with row stride `ldc`. `init`: c's value starts each sum. `diag`
/// cuts each row group's columns or steps (a causal block).
///
/// # Safety
/// Inside `L::enter`; the panels and c hold what they say.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn gemm<L: Tile>(
    a: *const f32,
    rows: usize,
    steps: usize,
    b: *const f32,
    pstride: usize,
    cols: usize,
    c: *mut f32,
    ldc: usize,
    init: bool,
    diag: Diag,
) {
    let (mr, nr) = (L::MR, L::NR);
    for i0 in (0..rows).step_by(mr) {
        let cols = match diag {
            Diag::Cols(d0) => cols.min(d0 + i0 + mr),
            _ => cols,
        };
        let kc = group_steps(diag, steps, i0);
        for j0 in (0..cols).step_by(nr) {
            // SAFETY: the contract's panels and c's block (i0, j0).
            unsafe {
                let dst = c.add(i0 * ldc + j0);
                let u = Micro::<f32> {
                    kc,
                    a: a.add(i0 * steps),
                    b: b.add((j0 / nr) * pstride),
                    init: if init { dst } else { core::ptr::null() },
                    ldi: ldc,
                    dst,
                    ldd: ldc,
                    rows: mr.min(rows - i0),
                    cols: nr.min(cols - j0),
                };
                L::micro::<f32, false, false, { crate::ops::matmul::ukernel::NO_PAIRS }>(&u);
            }
        }
    }
}

/// `acc = S B` over a causal block's rows: S the f32 block `s` (row stride
/// `ld`; row `r` holds its keys `..seen(r)`, at most `kmax`), B panels of
/// `cols` columns (stride `pstride`), `acc` f32 with row stride `ldc`. The
/// keys every row of a group sees (`diag`) run on the microkernel through
/// `pa` (`pack_a_f32`'s buffer), then each row's own diagonal one step at a
/// time, in key order: the sums of the forward's `P V` and dq's `dS K`.
///
/// # Safety
/// Inside `L::enter`; the buffers hold what `pack_a_f32` and `gemm` say;
/// `seen(r) <= kmax`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn causal_rows_times<L: Tile>(
    s: *const f32,
    ld: usize,
    rows: usize,
    kmax: usize,
    diag: Diag,
    seen: impl Fn(usize) -> usize,
    b: *const f32,
    pstride: usize,
    cols: usize,
    pa: *mut f32,
    acc: *mut f32,
    ldc: usize,
) {
    let groups = cols.div_ceil(GROUP);
    // SAFETY: the contract.
    unsafe {
        pack_a_f32::<L>(s, ld, rows, kmax, diag, pa);
        gemm::<L>(pa, rows, kmax, b, pstride, cols, acc, ldc, false, diag);
        for r in 0..rows {
            let orow = acc.add(r * ldc);
            for j in group_steps(diag, kmax, r / L::MR * L::MR)..seen(r) {
                axpy_step::<L>(orow, *s.add(r * ld + j), b, pstride, j, groups);
            }
        }
    }
}

/// Group `g` (columns `16 g ..`) of step `j` of B panels of stride `pstride`.
///
/// # Safety
/// Inside the panels.
#[inline(always)]
pub(super) unsafe fn panel_group<L: Tile>(p: *const f32, pstride: usize, j: usize, g: usize) -> L {
    let (nr, c) = (L::NR, g * GROUP);
    // SAFETY: the caller's.
    L::load(unsafe { &*(p.add((c / nr) * pstride + j * nr + c % nr) as *const [f32; GROUP]) })
}

/// `acc[.. d] += x * B step j` over the row's groups (`acc` f32).
///
/// # Safety
/// `acc` holds `dim_pad`; B as `panel_group`.
#[inline(always)]
pub(super) unsafe fn axpy_step<L: Tile>(
    acc: *mut f32,
    x: f32,
    p: *const f32,
    pstride: usize,
    j: usize,
    groups: usize,
) {
    let xv = L::splat(x);
    for g in 0..groups {
        // SAFETY: the caller's.
        unsafe {
            let o = &mut *(acc.add(g * GROUP) as *mut [f32; GROUP]);
            let bv = panel_group::<L>(p, pstride, j, g);
            xv.mul_add(bv, L::load(o)).store(o);
        }
    }
}
