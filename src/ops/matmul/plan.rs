//! Matmul's host side: validation and the cache-block plan (BLIS's five
//! loops, cut on the host like an Ascend tiling function).
//!
//! The output is cut into tiles of `mt x nc` (rows x columns); a worker
//! (block) takes tiles `w, w + blocks, ...`, so tiles never share an output
//! element and the thread count changes no bit. Per tile, K runs in slices
//! of `kc`: the slice of b is packed (`kc x nc`, kept in L2), then per
//! `mc`-row block of the tile the slice of a (`mc x kc`), and the
//! microkernel walks A micro-panels (in L1) against B micro-panels. Each
//! worker's arena holds those two packed operands and, when c is 16-bit
//! and K spans more than one slice, the tile's f32 partial sums.

use super::*;
use crate::dtype::DType;
use crate::error::{dtype_err, invalid_fmt, Error};
use crate::tensor::{no_overlap, Checked};
use crate::tiling::{UbConfig, NORM_FLAG_SERIAL, WORKSPACE_ALIGN};

/// Rows of a packed A block: a multiple of every microkernel's row count
/// (14 on AVX-512, 6 on AVX2 and NEON, 4 portable).
pub const MATMUL_MC: u32 = 168;
/// The K slice: a 14-row A micro-panel of it is 14 KiB (L1).
pub const MATMUL_KC: u32 = 256;
/// Columns of an output tile and of a packed B slice (`kc x nc` f32 =
/// 512 KiB, L2), a multiple of every microkernel's column count (32, 16).
pub const MATMUL_NC: u32 = 512;
/// f32 past `nc` in each row of the partial sums (their row stride).
pub(crate) const PARTIALS_PAD: usize = 16;
/// At most this many `mc` blocks make a tile's rows.
const MAX_MC_PER_TILE: usize = 4;
/// Calls of at most this many multiply-adds run on the calling thread.
const SERIAL_MAX_MACS: u64 = 1 << 16;

/// Matmul's tiling plan (its TilingData).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MatmulTiling {
    /// Rows of c.
    pub m: u64,
    /// Columns of c.
    pub n: u64,
    /// The summed dimension.
    pub k: u64,
    /// Rows of a packed A block.
    pub mc: u32,
    /// The K slice.
    pub kc: u32,
    /// Columns of a tile and of a packed B slice.
    pub nc: u32,
    /// Rows of a tile (a multiple of `mc`).
    pub mt: u32,
    /// Tiles down c.
    pub tiles_m: u32,
    /// Tiles across c.
    pub tiles_n: u32,
    /// Workers (blocks), each with its arena: `min(ub.blocks, tiles)`.
    pub blocks: u32,
    /// `NORM_FLAG_SERIAL` for a small call.
    pub flags: u32,
    /// 1: the arena holds the tile's f32 partial sums (K > kc).
    pub c_partials: u32,
    /// Padding (0).
    pub reserved: u32,
    /// Bytes of one worker's arena (64-byte multiple).
    pub arena_bytes: u64,
    /// Offset of the packed B slice in the arena (A is at 0).
    pub b_offset: u64,
    /// Offset of the partial sums in the arena.
    pub c_offset: u64,
    /// Workspace bytes: the arenas plus alignment slack.
    pub workspace_bytes: u64,
}

impl MatmulTiling {
    /// Tile `t`'s rows and columns: `(r0, r1, c0, c1)`. Tiles run down a
    /// column first, so that a worker's consecutive tiles share b's columns
    /// (its packed slice is reused when K is one slice).
    pub fn tile(&self, t: usize) -> (usize, usize, usize, usize) {
        let tm = (self.tiles_m as usize).max(1);
        let (ti, tj) = (t % tm, t / tm);
        let (mt, nc) = (self.mt as usize, self.nc as usize);
        let r0 = ti * mt;
        let c0 = tj * nc;
        (
            r0,
            (r0 + mt).min(self.m as usize),
            c0,
            (c0 + nc).min(self.n as usize),
        )
    }

    /// How many tiles the output has.
    pub fn tiles(&self) -> usize {
        self.tiles_m as usize * self.tiles_n as usize
    }
}

/// `(M, K)` of `a` or `(K, N)` of `b` after the transpose.
fn dims2(t: &Checked, trans: bool) -> Result<(usize, usize)> {
    let d = t.shape.dims();
    if d.len() != 2 {
        return Err(invalid_fmt!(
            t.name,
            "rank {} is not 2 (a matrix; fold batch dims into rows)",
            d.len()
        ));
    }
    Ok(if trans { (d[1], d[0]) } else { (d[0], d[1]) })
}

/// Checks a and b (dtype, rank, K); returns `(M, N, K)`.
fn operands(a: &RawTensor, b: &RawTensor, opts: &MatmulOptions) -> Result<(usize, usize, usize)> {
    let ac = a.check("a")?;
    if !a.dtype.is_float() {
        return Err(dtype_err!("a", "dtype {} is not f32, f16 or bf16", a.dtype));
    }
    let bc = b.check("b")?;
    if b.dtype != a.dtype {
        return Err(dtype_err!("b", "dtype {} is not a's {}", b.dtype, a.dtype));
    }
    let (m, k) = dims2(&ac, opts.trans_a)?;
    let (kb, n) = dims2(&bc, opts.trans_b)?;
    if kb != k {
        return Err(invalid_fmt!(
            "b",
            "shape {} gives K = {kb}, a's shape {} K = {k} (trans_a {}, trans_b {})",
            bc.shape,
            ac.shape,
            opts.trans_a as u8,
            opts.trans_b as u8
        ));
    }
    Ok((m, n, k))
}

/// `(M, N)` of the output, a and b checked (what the Rust front end sizes
/// its output view by).
pub(crate) fn out_dims(
    a: &RawTensor,
    b: &RawTensor,
    opts: &MatmulOptions,
) -> Result<(usize, usize)> {
    let (m, n, _) = operands(a, b, opts)?;
    Ok((m, n))
}

/// Validates the inputs and the output dtype and cuts the plan (what
/// `workspace_size` needs).
pub(crate) fn plan(
    a: &RawTensor,
    b: &RawTensor,
    out: DType,
    opts: &MatmulOptions,
    ub: &UbConfig,
) -> Result<MatmulTiling> {
    ub.validate()?;
    let (m, n, k) = operands(a, b, opts)?;
    if out != a.dtype && out != DType::F32 {
        return Err(dtype_err!(
            "c",
            "dtype {out} is neither a's ({}) nor f32",
            a.dtype
        ));
    }
    if opts.math != MatmulMath::Chain && a.dtype != DType::BF16 {
        return Err(invalid_fmt!(
            "math",
            "the bf16 pair dot ({}) needs bf16 a and b, not {}",
            opts.math as u32,
            a.dtype
        ));
    }
    if opts.accumulate && out != DType::F32 {
        return Err(dtype_err!(
            "c",
            "dtype {out}: accumulate needs an f32 c (the sum's partials stay f32)"
        ));
    }
    cut(m, n, k, opts.math != MatmulMath::Chain, ub)
}

/// The cache blocks and arenas for an `m x n` output summed over `k` (`dot`:
/// the bf16 pair dot, whose panels hold an even number of steps).
fn cut(m: usize, n: usize, k: usize, dot: bool, ub: &UbConfig) -> Result<MatmulTiling> {
    let ovf = Error::SizeOverflow { arg: "workspace" };
    let (mc, kc, nc) = (MATMUL_MC as usize, MATMUL_KC as usize, MATMUL_NC as usize);
    let tiles_n = n.div_ceil(nc);
    let blocks_m = m.div_ceil(mc);
    // Rows per tile: up to MAX_MC_PER_TILE blocks (fewer repacks of b),
    // fewer while that leaves workers without a tile.
    let mut per = MAX_MC_PER_TILE.min(blocks_m.max(1));
    while per > 1 && blocks_m.div_ceil(per) * tiles_n < ub.blocks as usize {
        per -= 1;
    }
    let mt = per * mc;
    let tiles_m = m.div_ceil(mt);
    let tiles = tiles_m.checked_mul(tiles_n).ok_or(ovf)?;
    let blocks = tiles.clamp(1, ub.blocks.max(1) as usize);
    // The sums carry between K slices in the arena's partials (row stride
    // nc + 16), an f32 c too: in c itself their rows were n apart, 4 KiB
    // for n = 1024, a block's 14 rows in one L1 set (2-3% on Zen 5).
    let c_partials = k > kc;
    let kk = k.clamp(1, kc);
    let kk = if dot { kk + (kk & 1) } else { kk };
    // Each buffer as large as this call can fill (a small matmul needs a
    // small workspace: the embedded targets). A panels packed by rows keep
    // the stride kc whatever the slice; their rows round up to 84, a
    // multiple of every microkernel's MR; B's columns to 32 (every NR
    // divides it).
    let a_rows = mc.min(m.div_ceil(84) * 84);
    let b_cols = nc.min(n.div_ceil(32) * 32);
    let a_bytes = a_rows * kc * 4;
    let b_bytes = kk * b_cols * 4;
    let c_bytes = if c_partials {
        mt.min(m) * (nc + PARTIALS_PAD) * 4
    } else {
        0
    };
    let round = |x: usize| x.div_ceil(WORKSPACE_ALIGN) * WORKSPACE_ALIGN;
    let b_offset = round(a_bytes);
    let c_offset = b_offset + round(b_bytes);
    let arena = c_offset + round(c_bytes);
    let ws = if m == 0 || n == 0 || k == 0 {
        0
    } else {
        arena
            .checked_mul(blocks)
            .and_then(|b| b.checked_add(WORKSPACE_ALIGN))
            .ok_or(ovf)?
    };
    let macs = (m as u64).saturating_mul(n as u64).saturating_mul(k as u64);
    let to32 = |v: usize, arg| u32::try_from(v).map_err(|_| Error::SizeOverflow { arg });
    Ok(MatmulTiling {
        m: m as u64,
        n: n as u64,
        k: k as u64,
        mc: mc as u32,
        kc: kc as u32,
        nc: nc as u32,
        mt: mt as u32,
        tiles_m: to32(tiles_m, "a")?,
        tiles_n: to32(tiles_n, "b")?,
        blocks: blocks as u32,
        flags: if macs <= SERIAL_MAX_MACS {
            NORM_FLAG_SERIAL
        } else {
            0
        },
        c_partials: c_partials as u32,
        reserved: 0,
        arena_bytes: arena as u64,
        b_offset: b_offset as u64,
        c_offset: c_offset as u64,
        workspace_bytes: ws as u64,
    })
}

/// Validates everything and builds the call.
pub(crate) fn prepare(
    a: &RawTensor,
    b: &RawTensor,
    opts: &MatmulOptions,
    c: &RawTensor,
    ub: &UbConfig,
) -> Result<MatmulCall> {
    let tiling = plan(a, b, c.dtype, opts, ub)?;
    let cc = c.check("c")?;
    let want = [tiling.m as usize, tiling.n as usize];
    if cc.shape.dims() != want {
        let w = crate::tensor::Shape::new(&want)?;
        return Err(invalid_fmt!("c", "shape {} is not {w}", cc.shape));
    }
    no_overlap(&cc, [&a.check("a")?, &b.check("b")?])?;
    Ok(MatmulCall {
        a: *a,
        b: *b,
        c: *c,
        trans_a: opts.trans_a as u32,
        trans_b: opts.trans_b as u32,
        accumulate: opts.accumulate as u32,
        tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
        math: opts.math as u32,
        reserved: 0,
    })
}
