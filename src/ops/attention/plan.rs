//! Attention's host side: validation and the plan.
//!
//! The forward's units are blocks of `rows` query rows of one query head
//! (they share nothing: any worker may take any); the backward's are
//! key/value heads, each summing its keys' gradients over its group's query
//! heads and rows in one fixed order — or, with fewer key/value heads than
//! workers, two phases: blocks of a head's keys (each key's sums in that
//! same order), then blocks of query rows (dq), recomputing the scores in
//! each: more work, as many units as the forward's, the same bits. A worker takes units `w, w + blocks,
//! ...`, so the thread count changes no bit.

use super::*;
use crate::dtype::DType;
use crate::error::{dtype_err, invalid, invalid_fmt, Error};
use crate::ops::swiglu::plan::empty;
use crate::tensor::{no_overlap, Checked, Shape};
use crate::tiling::{UbConfig, NORM_FLAG_SERIAL, WORKSPACE_ALIGN};

/// Query rows per block: a multiple of every microkernel's row count (14,
/// 6, 4); its scores against 1 024 keys are 336 KiB of f32.
pub const ATTENTION_ROWS: u32 = 84;
/// Calls of at most this many multiply-adds run on the calling thread.
const SERIAL_MAX_MACS: u64 = 1 << 16;
/// Panel columns every microkernel's `NR` divides.
const COLS: usize = 32;

/// Attention's plan (its TilingData).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionTiling {
    /// Batch.
    pub batch: u64,
    /// Query heads.
    pub heads_q: u64,
    /// Key/value heads (divides `heads_q`).
    pub heads_kv: u64,
    /// Query rows per head.
    pub seq_q: u64,
    /// Keys per head.
    pub seq_kv: u64,
    /// The head dim.
    pub head_dim: u64,
    /// Query rows per block.
    pub rows: u32,
    /// Blocks per query head: `ceil(seq_q / rows)`.
    pub q_blocks: u32,
    /// Units of work: forward `batch * heads_q * q_blocks`, backward
    /// `batch * heads_kv`, split backward `batch * heads_kv * kv_blocks`
    /// (its first phase).
    pub units: u64,
    /// The split backward's second phase (dq): `batch * heads_q *
    /// q_blocks` units; 0 otherwise.
    pub dq_units: u64,
    /// Key blocks (of `rows` keys) per key/value head: `ceil(seq_kv /
    /// rows)`.
    pub kv_blocks: u32,
    /// 1: the backward runs in two phases (fewer key/value heads than
    /// workers): dk and dv per key block, then dq per query block, the
    /// scores and dP computed in both (the same bits as one pass).
    pub split: u32,
    /// Workers, each with its arena: `min(ub.blocks, units)`.
    pub blocks: u32,
    /// `NORM_FLAG_SERIAL` for a small call.
    pub flags: u32,
    /// Keys rounded for the packed panels (`seq_kv + 16` up to 32).
    pub kv_pad: u64,
    /// The head dim rounded up to 32.
    pub dim_pad: u64,
    /// Bytes of one worker's arena (64-byte multiple).
    pub arena_bytes: u64,
    /// Workspace bytes: the arenas plus alignment slack.
    pub workspace_bytes: u64,
}

/// Where each buffer sits in a worker's arena, in f32 from its start.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Arena {
    /// k^T as B panels: `head_dim` steps of the keys.
    pub kt: usize,
    /// v as B panels: the keys' steps of `head_dim` columns.
    pub vp: usize,
    /// The query block as A panels (head_dim steps of MR rows).
    pub qa: usize,
    /// The block's scores, then probabilities (row stride `kv_pad`).
    pub s: usize,
    /// A panels repacked from `s` or `dp`.
    pub pa: usize,
    /// The block's output (or dq) sums (row stride `dim_pad`).
    pub acc: usize,
    /// Backward: v^T as B panels.
    pub vt: usize,
    /// Backward: k as B panels.
    pub kp: usize,
    /// Backward: the output gradient's block as A panels.
    pub doa: usize,
    /// Backward: the query block as B panels.
    pub qb: usize,
    /// Backward: the output gradient's block as B panels.
    pub dob: usize,
    /// Backward: the block's dP, then dS (row stride `kv_pad`).
    pub dp: usize,
    /// Backward: dk's sums (row stride `dim_pad`).
    pub dk: usize,
    /// Backward: dv's sums.
    pub dv: usize,
    /// f32 in all.
    pub len: usize,
}

impl AttentionTiling {
    /// The arena's buffers (sizes checked by `plan`).
    pub(crate) fn arena(&self, backward: bool) -> Arena {
        arena(
            self.rows as usize,
            self.kv_pad as usize,
            self.dim_pad as usize,
            self.head_dim as usize,
            backward,
        )
        .unwrap_or_default()
    }

    /// The shape of `softmax_max` / `softmax_sum`: `[B, Hq, Sq]`.
    pub fn stats_shape(&self) -> Result<Shape> {
        Shape::new_named(
            &[
                self.batch as usize,
                self.heads_q as usize,
                self.seq_q as usize,
            ],
            "softmax_max",
        )
    }
}

/// The arena's layout; `None` when its size overflows.
fn arena(r: usize, kp: usize, dp: usize, d: usize, backward: bool) -> Option<Arena> {
    let mut at = 0usize;
    let mut take = |n: Option<usize>| -> Option<usize> {
        let here = at;
        // Each buffer on its own cache lines.
        let n = n?.checked_next_multiple_of(16)?;
        at = at.checked_add(n)?;
        Some(here)
    };
    let dkp = d.checked_mul(kp);
    let kpd = kp.checked_mul(dp);
    let mut a = Arena {
        kt: take(dkp)?,
        vp: take(kpd)?,
        // 16 f32 of slack after each vector-packed buffer: the last spill.
        qa: take(d.checked_mul(r).and_then(|x| x.checked_add(16)))?,
        s: take(r.checked_mul(kp))?,
        pa: take(kp.checked_mul(r).and_then(|x| x.checked_add(16)))?,
        acc: take(r.checked_mul(dp))?,
        ..Arena::default()
    };
    if backward {
        a.vt = take(dkp)?;
        a.kp = take(kpd)?;
        a.doa = take(d.checked_mul(r).and_then(|x| x.checked_add(16)))?;
        a.qb = take(r.checked_mul(dp))?;
        a.dob = take(r.checked_mul(dp))?;
        a.dp = take(r.checked_mul(kp))?;
        a.dk = take(kpd)?;
        a.dv = take(kpd)?;
    }
    a.len = at;
    Some(a)
}

/// The inputs a plan depends on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttentionInputs {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub opts: AttentionOptions,
    pub backward: bool,
}

impl AttentionInputs {
    /// Bundles them.
    pub(crate) fn new(
        q: RawTensor,
        k: RawTensor,
        v: RawTensor,
        opts: &AttentionOptions,
        backward: bool,
    ) -> Self {
        AttentionInputs {
            q,
            k,
            v,
            opts: *opts,
            backward,
        }
    }
}

/// The tensors beside q, k and v: the forward writes `out` and the stats;
/// the backward reads them and `dout`, and writes dq, dk, dv.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttentionOutputs {
    pub out: RawTensor,
    pub softmax_max: RawTensor,
    pub softmax_sum: RawTensor,
    pub dout: RawTensor,
    pub dq: RawTensor,
    pub dk: RawTensor,
    pub dv: RawTensor,
}

impl AttentionOutputs {
    /// The forward's: the gradients empty.
    pub(crate) fn forward(out: RawTensor, mx: RawTensor, sm: RawTensor) -> Self {
        let e = empty(out.dtype);
        AttentionOutputs {
            out,
            softmax_max: mx,
            softmax_sum: sm,
            dout: e,
            dq: e,
            dk: e,
            dv: e,
        }
    }
}

/// `(batch, heads, seq, head_dim)` of a 4-D q, k or v in `layout`.
fn dims4(c: &Checked, layout: AttentionLayout) -> Result<[usize; 4]> {
    let d = c.shape.dims();
    if d.len() != 4 {
        return Err(invalid_fmt!(
            c.name,
            "rank {} is not 4 ({})",
            d.len(),
            match layout {
                AttentionLayout::Bnsd => "[batch, heads, seq, head_dim]",
                AttentionLayout::Bsnd => "[batch, seq, heads, head_dim]",
            }
        ));
    }
    Ok(match layout {
        AttentionLayout::Bnsd => [d[0], d[1], d[2], d[3]],
        AttentionLayout::Bsnd => [d[0], d[2], d[1], d[3]],
    })
}

/// Validates the inputs and options and cuts the plan (what
/// `workspace_size` needs).
pub(crate) fn plan(inp: &AttentionInputs, ub: &UbConfig) -> Result<AttentionTiling> {
    ub.validate()?;
    let o = &inp.opts;
    if !o.scale.is_finite() {
        return Err(invalid_fmt!("scale", "{} is not finite", o.scale));
    }
    let qc = inp.q.check("q")?;
    if !inp.q.dtype.is_float() {
        return Err(dtype_err!(
            "q",
            "dtype {} is not f32, f16 or bf16",
            inp.q.dtype
        ));
    }
    let kc = inp.k.check("k")?;
    let vc = inp.v.check("v")?;
    for (t, n) in [(&inp.k, "k"), (&inp.v, "v")] {
        if t.dtype != inp.q.dtype {
            return Err(dtype_err!(
                n,
                "dtype {} is not q's {}",
                t.dtype,
                inp.q.dtype
            ));
        }
    }
    let [b, hq, sq, d] = dims4(&qc, o.layout)?;
    let [bk, hkv, skv, dk] = dims4(&kc, o.layout)?;
    dims4(&vc, o.layout)?;
    if vc.shape.dims() != kc.shape.dims() {
        return Err(invalid_fmt!(
            "v",
            "shape {} is not k's {}",
            vc.shape,
            kc.shape
        ));
    }
    if bk != b || dk != d {
        return Err(invalid_fmt!(
            "k",
            "shape {} does not match q's {} (batch and head_dim must be equal)",
            kc.shape,
            qc.shape
        ));
    }
    if d == 0 {
        return Err(invalid("q", "head_dim is 0"));
    }
    if hkv == 0 {
        if hq != 0 {
            return Err(invalid(
                "k",
                "0 key/value heads for a nonzero number of query heads",
            ));
        }
    } else if hq % hkv != 0 {
        return Err(invalid_fmt!(
            "k",
            "{hkv} key/value heads do not divide q's {hq} heads"
        ));
    }
    let work = b.checked_mul(hq).and_then(|x| x.checked_mul(sq));
    let work = work.ok_or(Error::SizeOverflow { arg: "q" })?;
    if skv == 0 && work > 0 {
        return Err(invalid(
            "k",
            "no keys: the softmax of an empty row is undefined",
        ));
    }
    let ovf = |arg| Error::SizeOverflow { arg };
    let rows = ATTENTION_ROWS as usize;
    let q_blocks = sq.div_ceil(rows);
    let kv_blocks = skv.div_ceil(rows);
    let q_units = b
        .checked_mul(hq)
        .and_then(|x| x.checked_mul(q_blocks))
        .ok_or(ovf("q"))?;
    let head_units = b.checked_mul(hkv).ok_or(ovf("k"))?;
    let split = inp.backward && q_blocks > 0 && kv_blocks > 1 && head_units < ub.blocks as usize;
    let (units, dq_units) = if split {
        let kv_units = head_units.checked_mul(kv_blocks).ok_or(ovf("k"))?;
        (kv_units, q_units)
    } else if inp.backward {
        (head_units, 0)
    } else {
        (q_units, 0)
    };
    let kv_pad = skv
        .checked_add(16)
        .and_then(|x| x.checked_next_multiple_of(COLS))
        .ok_or(ovf("k"))?;
    let dim_pad = d.checked_next_multiple_of(COLS).ok_or(ovf("q"))?;
    let layout = arena(rows, kv_pad, dim_pad, d, inp.backward).ok_or(ovf("workspace"))?;
    let arena_bytes = layout
        .len
        .checked_mul(4)
        .and_then(|x| x.checked_next_multiple_of(WORKSPACE_ALIGN))
        .ok_or(ovf("workspace"))?;
    let blocks = units.max(dq_units).clamp(1, ub.blocks.max(1) as usize);
    let ws = if units == 0 {
        0
    } else {
        arena_bytes
            .checked_mul(blocks)
            .and_then(|x| x.checked_add(WORKSPACE_ALIGN))
            .ok_or(ovf("workspace"))?
    };
    let macs = (work as u64)
        .saturating_mul(skv as u64)
        .saturating_mul(d as u64);
    Ok(AttentionTiling {
        batch: b as u64,
        heads_q: hq as u64,
        heads_kv: hkv as u64,
        seq_q: sq as u64,
        seq_kv: skv as u64,
        head_dim: d as u64,
        rows: ATTENTION_ROWS,
        q_blocks: u32::try_from(q_blocks).map_err(|_| ovf("q"))?,
        units: units as u64,
        dq_units: dq_units as u64,
        kv_blocks: u32::try_from(kv_blocks).map_err(|_| ovf("k"))?,
        split: split as u32,
        blocks: blocks as u32,
        flags: if macs <= SERIAL_MAX_MACS {
            NORM_FLAG_SERIAL
        } else {
            0
        },
        kv_pad: kv_pad as u64,
        dim_pad: dim_pad as u64,
        arena_bytes: arena_bytes as u64,
        workspace_bytes: ws as u64,
    })
}

/// Checks `t` is `shape` of `dtype`.
fn like(
    t: &RawTensor,
    name: &'static str,
    shape: &Shape,
    dtype: DType,
    of: &str,
) -> Result<Checked> {
    let c = t.check(name)?;
    if t.dtype != dtype {
        return Err(dtype_err!(name, "dtype {} is not {dtype}", t.dtype));
    }
    if c.shape.dims() != shape.dims() {
        return Err(invalid_fmt!(
            name,
            "shape {} is not {of}'s {shape}",
            c.shape
        ));
    }
    Ok(c)
}

/// Validates everything and builds the call.
pub(crate) fn prepare(
    inp: &AttentionInputs,
    outs: &AttentionOutputs,
    ub: &UbConfig,
) -> Result<AttentionCall> {
    let tiling = plan(inp, ub)?;
    let (qc, kc, vc) = (inp.q.check("q")?, inp.k.check("k")?, inp.v.check("v")?);
    let dt = inp.q.dtype;
    let stats = tiling.stats_shape()?;
    let oc = like(&outs.out, "out", &qc.shape, dt, "q")?;
    let mc = like(
        &outs.softmax_max,
        "softmax_max",
        &stats,
        DType::F32,
        "[B, Hq, Sq]",
    )?;
    let sc = like(
        &outs.softmax_sum,
        "softmax_sum",
        &stats,
        DType::F32,
        "[B, Hq, Sq]",
    )?;
    let call = |dout, dq, dk, dv| AttentionCall {
        q: inp.q,
        k: inp.k,
        v: inp.v,
        out: outs.out,
        softmax_max: outs.softmax_max,
        softmax_sum: outs.softmax_sum,
        dout,
        dq,
        dk,
        dv,
        backward: inp.backward as u32,
        causal: inp.opts.causal as u32,
        layout: inp.opts.layout as u32,
        scale: inp.opts.scale,
        tiling,
        workspace: core::ptr::null_mut(),
        workspace_bytes: 0,
    };
    if !inp.backward {
        for w in [&oc, &mc, &sc] {
            no_overlap(w, [&qc, &kc, &vc])?;
        }
        no_overlap(&oc, [&mc, &sc])?;
        no_overlap(&mc, [&sc])?;
        let e = empty(dt);
        return Ok(call(e, e, e, e));
    }
    let doc = like(&outs.dout, "dout", &qc.shape, dt, "q")?;
    let dqc = like(&outs.dq, "dq", &qc.shape, dt, "q")?;
    let dkc = like(&outs.dk, "dk", &kc.shape, dt, "k")?;
    let dvc = like(&outs.dv, "dv", &kc.shape, dt, "k")?;
    for w in [&dqc, &dkc, &dvc] {
        no_overlap(w, [&qc, &kc, &vc, &oc, &mc, &sc, &doc])?;
    }
    no_overlap(&dqc, [&dkc, &dvc])?;
    no_overlap(&dkc, [&dvc])?;
    Ok(call(outs.dout, outs.dq, outs.dk, outs.dv))
}
