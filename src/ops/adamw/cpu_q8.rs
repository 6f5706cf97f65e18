//! AdamW's pass with 8-bit moments on the CPU, by quantization block: its
//! codes decoded into f32 buffers, the block stepped through the same lanes
//! as the other formats (`piece_step`), then coded again against its new
//! maximum, a group at a time (`Coder`).
//!
//! Tried and not kept (Sapphire Rapids, `NPK_ADAMW_ELEMS=65536`, one core):
//! coding a block a group beside each group of the next block's update, so
//! that the update's divisions and the coding's integer work overlap: 12%
//! slower (108 against 95-96 us; 20% slower before the two sets of buffers
//! were kept off each other's 4 KiB aliases).
//! Tried again on Zen 5 with the step's constants built once (so a group's
//! step is a cheap call): 35% slower (59 against 43.5 us). And a third time
//! on Zen 5 with two padded slots and no call or copy in the loop (checked
//! in the disassembly): 57-60 against 44 us. What the profile shows: the
//! samples sit on the step's chain (load, moments, sqrt, two divisions,
//! the split), whose ~70 cycles the out-of-order window must cover with
//! several groups at once; the coding's instructions placed between them
//! take window entries, so fewer groups' divisions overlap. Issuing a
//! group's second stage after the next group's first (software
//! pipelining) was 5-13% slower too.
//! Tried on Zen 5 (2026-12-06): chunks of 8 quantization blocks, each
//! phase one loop over the chunk (decode, the step as one 2048-element
//! piece, every block's scale, the random bits, the codes), so the step's
//! chain drains once a chunk: 45-53 against 38-39 us. And the update as
//! bitsandbytes writes it, one division fewer (`m / (sqrt(v) + eps')`):
//! the float32-master step 12.4 against 15.4 us, the 8-bit pass 40.2-40.6
//! against 40.2-42.8, within noise: the division is not what bounds it.
//! Tried on Zen 5 (2026-12-07, `NPK_ADAMW_ELEMS=65536`, the least of 5
//! alternated runs): the block's step in two loops, the moments decoded,
//! stepped and their maxima taken in the first (few instructions behind
//! the division chain: 15-16 cycles a group against 19), the params in a
//! second: 37.1 against 38.8 us, then 38.9 against 38.8, within noise.
//! And skipping the codes' tests below the smallest normal code in blocks
//! whose least |value| normalizes above it (87% of the bench's blocks):
//! the coding loop halves (9 to 4.3 us), but finding each block's least
//! |value| costs as much (+2.8 us): 38.1 against 38.1. Removing the tests
//! outright (wrong codes, the bound of that route): 35.4.
//! Measured on Zen 5 (2026-12-07, later; same bench, 20 samples): the
//! pass 38.4 us; with the block's step skipped (wrong moments: the decode,
//! maxima, random bits and codes alone) 17.4; the split step alone on f32
//! moments (`adamw/split`) 17.2. The two halves add up: neither overlaps
//! the other. The step is bound by its chain (sqrt and two divisions,
//! ~60 cycles) and the window, not by the divider (zmm `vsqrtps` ~4.5
//! cycles and `vdivps` ~1.9 at throughput here: ~8 a group of 16) nor the
//! ALUs (~35 vector operations a group); the rest is ALU-bound (~65). A
//! perfect overlap (~100 ALU operations a group, 4 a cycle: ~27 us at ~3.8
//! GHz) would still miss the 1.1x-copy target (~26 us at this size): it
//! needs fewer operations as well as the overlap. The random bits moved before
//! the decode or right after the step: 38.9-39.3 and 40.7 us, not kept.
//! Tried on Zen 5 (2026-12-07, evening; the host slower: the pass read
//! 41-47 us): each block in one pass a group at a time, no f32 buffers
//! (decode, step, code in registers), against scales fixed before the step
//! that bound its new moments: `b1 M + (1 - b1) G` and `b2 V + (1 - b2) G^2`,
//! rounded as the step rounds them (M, V the old moments' largest, read
//! off the largest codes, G the gradients' largest |value|, one pre-pass),
//! so no block maximum waits for the step. 43-50 us; split into two loops
//! (moments, their codes and each update term; then the params) 42-45. The
//! fused loop was 62 instructions a group, all vector, at ~2.8 a cycle;
//! with its square root and divisions replaced by multiplications (wrong
//! values: the bound of that route) 39-43 us. Neither the divider nor the
//! buffers are what is left; the format change (scales that bound rather
//! than equal a block's maximum) was not kept.

use super::cpu::{consts, masters, piece_step_with, randoms, Piece, K};
use super::formats::salt;
use super::q8::{q8_code, q8_decode, q8_inverse, q8_scale, Q8Grid, Q8_BLOCK, STREAM_Q8};
use super::{AdamWCall, AdamWConsts};
use crate::dtype::Float;
use crate::lanes::{Lanes, GROUP};
use crate::runner::Runner;
use crate::tensor_list::ListSeg;
use core::mem::size_of;

/// Groups of a quantization block.
const GROUPS: usize = Q8_BLOCK / GROUP;

/// The decoded moments of one block: exp_avg, exp_avg_sq, and amsgrad's
/// maximum.
type Bufs = [[f32; Q8_BLOCK]; 3];

/// The step with 8-bit moments: block `b` steps the quantization blocks
/// (each row's, `Q8Grid`) whose first element lies in its flat range (so
/// none is cut).
///
/// # Safety
/// As `cpu::run`'s.
pub(super) unsafe fn run_q8<L: Lanes, P: Float, G: Float>(
    call: &AdamWCall,
    k: &AdamWConsts,
    ams: bool,
    runner: &dyn Runner,
) {
    let t = call.tiling;
    let nb = t.blocks as usize;
    // SAFETY: the front end wrote each present list's table (and the keys).
    let (tables, scales, keys, grids) = unsafe {
        (
            call.tables(),
            call.scale_tables(),
            call.keys(),
            call.q8_rows(),
        )
    };
    let ps = tables[0];
    let (state, step) = (call.state, call.options.step);
    let q8_salt = salt(state.seed, step, STREAM_Q8);
    runner.parallel_for(nb, &|b| {
        if b >= nb {
            return;
        }
        // SAFETY: the rows describe validated, pairwise disjoint tensors;
        // each quantization block is its block's alone; `L` is available.
        unsafe {
            L::enter(
                #[inline(always)]
                || {
                    // The step's constants once for all the block's
                    // quantization blocks (they were a block's setup each).
                    let c = consts::<L>(k, &state, step);
                    let (s, e) = t.block_range(b);
                    let first = ps.partition_point(|g| g.end() <= s);
                    // The decoded moments and the random bits of one
                    // quantization block, reused by each.
                    let mut bufs = [[0f32; Q8_BLOCK]; 3];
                    let mut rs = [[0u32; GROUP]; GROUPS];
                    for (r, row) in ps.iter().enumerate().skip(first) {
                        if row.start >= e {
                            break;
                        }
                        let lo = s.max(row.start) - row.start;
                        let hi = e.min(row.end()) - row.start;
                        let len = grids.get(r).map_or(0, |&l| l as usize);
                        let grid = Q8Grid::new(row.numel, len);
                        for (at, n, q) in grid.blocks(lo, hi) {
                            let key = keys.get(r).map_or(0, |k| k.wrapping_add(at as u64));
                            let blk = Block {
                                tables: &tables,
                                scales: &scales,
                                r,
                                at,
                                n,
                                q,
                                key,
                            };
                            q8_block::<L, P, G>(&blk, &c, &state, ams, q8_salt, &mut bufs, &mut rs);
                        }
                    }
                },
            )
        };
    });
}

/// Where one quantization block is.
struct Block<'a> {
    tables: &'a [&'a [ListSeg]; 6],
    scales: &'a [&'a [ListSeg]; 3],
    r: usize,
    at: usize,
    n: usize,
    /// Its scale's index (`Q8Grid::scale_of`).
    q: usize,
    key: u64,
}

/// One quantization block of row `r`: `n` (<= 256) elements from `at`,
/// decoded into `bufs`, stepped, and coded again.
///
/// # Safety
/// The tables are the call's; the block is the caller's alone.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn q8_block<L: Lanes, P: Float, G: Float>(
    b: &Block<'_>,
    c: &K<L>,
    st: &super::AdamWState,
    ams: bool,
    q8_salt: u32,
    [m, v, x]: &mut Bufs,
    rs: &mut [[u32; GROUP]; GROUPS],
) {
    let [ps, gs, ms, vs, xs, ws] = *b.tables;
    let (r, at, n, q) = (b.r, b.at, b.n, b.q);
    let code = |l: &[ListSeg]| (l[r].data as *mut u8).wrapping_add(at);
    let scale = |l: &[ListSeg]| (l[r].data as *mut f32).wrapping_add(q);
    let (cm, cv) = (code(ms), code(vs));
    // The next block's codes, a block ahead as the other streams (an
    // address past the tensor is never dereferenced: a prefetch does not
    // fault).
    for l in (0..Q8_BLOCK).step_by(64) {
        L::prefetch(cm.wrapping_add(Q8_BLOCK + l));
        L::prefetch(cv.wrapping_add(Q8_BLOCK + l));
    }
    // SAFETY: the codes' `n` elements from `at` and the block's scale are
    // this block's (validated lengths: one scale per block of the grid).
    unsafe {
        decode::<true>(m, cm, *scale(b.scales[0]), n);
        decode::<false>(v, cv, *scale(b.scales[1]), n);
        if ams {
            decode::<false>(x, code(xs), *scale(b.scales[2]), n);
        }
    }
    let split_masters = st.split_masters != 0;
    let at_ = |l: &[ListSeg], size: usize| -> *mut u8 {
        l.get(r).map_or(core::ptr::null_mut(), |s| {
            (s.data as *mut u8).wrapping_add(at * size)
        })
    };
    let (master, low) = masters(split_masters, |size| at_(ws, size));
    let piece = Piece::<P, G, f32> {
        p: at_(ps, size_of::<P>()).cast(),
        g: at_(gs, size_of::<G>()).cast(),
        m: m.as_mut_ptr(),
        v: v.as_mut_ptr(),
        vmax: if ams {
            x.as_mut_ptr()
        } else {
            core::ptr::null_mut()
        },
        master,
        low,
        key: b.key,
    };
    // SAFETY: the params, grads and masters of the block are its own; the
    // moments are the local buffers (n <= 256 elements each).
    unsafe { piece_step_with::<L, P, G, f32>(&piece, n, c) };
    let (sm, sv) = q8_scale2(&m[..n], &v[..n]);
    let scales = [sm, sv, if ams { q8_scale(&x[..n]) } else { 0.0 }];
    for (j, s) in scales.iter().enumerate().take(2 + ams as usize) {
        // SAFETY: the block's scales, its own.
        unsafe { scale(b.scales[j]).write(*s) };
    }
    let codes = [cm, cv, if ams { code(xs) } else { core::ptr::null_mut() }];
    let coder = Coder::<L>::new(scales, n, q8_salt, b.key, ams, rs);
    // A loop per case, not a test per group (or per element); full groups
    // in the loop, a partial last one after it.
    let full = n / GROUP;
    if coder.plain() {
        for (g, r) in rs.iter().enumerate().take(full) {
            // SAFETY: the block's codes (`n` of each from `at`) are its own.
            unsafe { coder.group::<true, true>(m, v, x, codes, g, r) };
        }
    } else {
        for (g, r) in rs.iter().enumerate().take(full) {
            // SAFETY: as above.
            unsafe { coder.group::<false, true>(m, v, x, codes, g, r) };
        }
    }
    if full * GROUP < n {
        // SAFETY: as above.
        unsafe { coder.group::<false, false>(m, v, x, codes, full, &rs[full]) };
    }
}

/// Codes a stepped block, a group at a time: exp_avg signed with the low
/// 16 bits of the element's hash, exp_avg_sq and its maximum unsigned with
/// the high 16 (one hash an element for all three).
struct Coder<L> {
    n: usize,
    ams: bool,
    /// Each moment's normalization.
    f: [Factors<L>; 3],
}

impl<L: Lanes> Coder<L> {
    /// The coder of a block of `n` elements with these new scales (inside
    /// the ISA's context: the factors are lanes).
    #[inline(always)]
    fn new(
        scales: [f32; 3],
        n: usize,
        salt: u32,
        key: u64,
        ams: bool,
        rs: &mut [[u32; GROUP]; GROUPS],
    ) -> Self {
        // The random bits in a loop of their own: the hashes' multiply
        // chains overlap there (inside the coding loop they did not: 13 us
        // of 105 per 2^16 elements). Into the caller's buffer: a 1 KiB
        // array moved into the coder was a `memcpy` a block.
        for (g, r) in rs.iter_mut().enumerate().take(n.div_ceil(GROUP)) {
            *r = randoms::<L>(salt, key.wrapping_add((g * GROUP) as u64));
        }
        Coder {
            n,
            ams,
            // (q8_inverse divides: the maximum's only with amsgrad.)
            f: [
                Factors::new(scales[0]),
                Factors::new(scales[1]),
                Factors::new(if ams { scales[2] } else { 1.0 }),
            ],
        }
    }

    /// Every moment coded has codes and a normal scale (no prescaling):
    /// `group::<true, _>` may skip their tests and the multiplication by 1.
    #[inline(always)]
    fn plain(&self) -> bool {
        let n = 2 + self.ams as usize;
        self.f[..n].iter().all(|f| f.live && f.pre_is_one)
    }

    /// The codes of group `g` (of the first `n` elements) of each moment
    /// (`PLAIN`: `plain()` holds; `FULL`: the group has 16 elements).
    ///
    /// # Safety
    /// `codes` are writable for the block's `n` codes (the maximum's only
    /// with amsgrad).
    #[inline(always)]
    unsafe fn group<const PLAIN: bool, const FULL: bool>(
        &self,
        m: &[f32; Q8_BLOCK],
        v: &[f32; Q8_BLOCK],
        x: &[f32; Q8_BLOCK],
        codes: [*mut u8; 3],
        g: usize,
        r: &[u32; GROUP],
    ) {
        let i = g * GROUP;
        let len = if FULL { GROUP } else { (self.n - i).min(GROUP) };
        let a = code_group::<L, true, 0, PLAIN>(m, i, &self.f[0], r);
        let b = code_group::<L, false, 16, PLAIN>(v, i, &self.f[1], r);
        // SAFETY: the caller's contract.
        unsafe {
            put(a, codes[0].add(i), len);
            put(b, codes[1].add(i), len);
        }
        if self.ams {
            let c = code_group::<L, false, 16, PLAIN>(x, i, &self.f[2], r);
            // SAFETY: as above.
            unsafe { put(c, codes[2].add(i), len) };
        }
    }
}

/// `len` (<= 16) codes to `dst`: one store for a whole group.
///
/// # Safety
/// `dst` is writable for `len` bytes.
#[inline(always)]
unsafe fn put(c: [u8; GROUP], dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe {
        if len == GROUP {
            dst.cast::<[u8; GROUP]>().write_unaligned(c);
        } else {
            core::ptr::copy_nonoverlapping(c.as_ptr(), dst, len);
        }
    }
}

/// The first `n` values of a block from their codes and scale.
///
/// # Safety
/// `codes` is readable for `n` <= 256 bytes.
#[inline(always)]
unsafe fn decode<const SIGNED: bool>(
    dst: &mut [f32; Q8_BLOCK],
    codes: *const u8,
    s: f32,
    n: usize,
) {
    // SAFETY: the caller's contract.
    let c = unsafe { core::slice::from_raw_parts(codes, n) };
    for (d, &c) in dst.iter_mut().zip(c) {
        *d = q8_decode::<SIGNED>(s, c);
    }
}

/// `q8_scale` of two blocks in one pass.
#[inline(always)]
fn q8_scale2(m: &[f32], v: &[f32]) -> (f32, f32) {
    let (mut a, mut b) = (0u32, 0u32);
    for (x, y) in m.iter().zip(v) {
        a = a.max(x.to_bits() & 0x7fff_ffff);
        b = b.max(y.to_bits() & 0x7fff_ffff);
    }
    (f32::from_bits(a), f32::from_bits(b))
}

/// A block's normalization as lanes (`q8_inverse`) and whether it has
/// codes.
struct Factors<L> {
    pre: L,
    rcp: L,
    live: bool,
    /// `pre` is 1 (a normal scale).
    pre_is_one: bool,
}

impl<L: Lanes> Factors<L> {
    #[inline(always)]
    fn new(scale: f32) -> Self {
        let (pre, rcp) = q8_inverse(scale);
        Factors {
            pre: L::splat(pre),
            rcp: L::splat(rcp),
            live: super::q8::live(scale),
            pre_is_one: pre == 1.0,
        }
    }
}

/// The codes of the group at `i` of a block (a function, not a closure: a
/// closure may be compiled outside the ISA's target features, every lane
/// operation a call), with the random bits `r >> SHIFT`.
#[inline(always)]
fn code_group<L: Lanes, const SIGNED: bool, const SHIFT: u32, const PLAIN: bool>(
    x: &[f32; Q8_BLOCK],
    i: usize,
    f: &Factors<L>,
    r: &[u32; GROUP],
) -> [u8; GROUP] {
    let xg: &[f32; GROUP] = x
        .get(i..i + GROUP)
        .and_then(|s| s.try_into().ok())
        .unwrap_or(&[0.0; GROUP]);
    let mut a = [0f32; GROUP];
    for j in 0..GROUP {
        a[j] = f32::from_bits(xg[j].to_bits() & 0x7fff_ffff);
    }
    // The normalized values: two IEEE multiplications on every ISA.
    let mut y = [0f32; GROUP];
    // (A prescaling by 1 is exact: skipped when PLAIN.)
    let a = L::load(&a);
    let a = if PLAIN { a } else { a.mul(f.pre) };
    a.mul(f.rcp).store(&mut y);
    let live = PLAIN || f.live;
    let mut c = [0u8; GROUP];
    for j in 0..GROUP {
        c[j] = q8_code::<SIGNED>(y[j], xg[j].to_bits(), r[j] >> SHIFT, live);
    }
    c
}
