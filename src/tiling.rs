//! Host-side tiling, as an Ascend C operator's `op_host` tiling function does
//! it: from the shapes and a `UbConfig` it fixes how rows are split over blocks
//! (AI cores / workers), how a block streams its rows through its Unified
//! Buffer sized arena (merge-N: several short rows per tile; split-D: one long
//! row in column chunks), and where everything lives in the caller's workspace.
//! Plans are `#[repr(C)]`: they are the TilingData an NPU kernel would receive.

use crate::error::{invalid, Error, Result};
use crate::lanes::GROUP;

/// Default Unified Buffer size: Atlas A2's 192 KiB.
pub const DEFAULT_UB_BYTES: usize = 196_608;
/// Default number of blocks a plan is cut for.
pub const DEFAULT_BLOCKS: u32 = 64;
/// Smallest accepted `ub_bytes`.
pub const MIN_UB_BYTES: usize = 1024;
/// Alignment of every region carved from the workspace (a cache line, and an
/// AVX-512 vector).
pub const WORKSPACE_ALIGN: usize = 64;

/// The machine model a plan is cut for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UbConfig {
    /// Bytes of scratch ("Unified Buffer") each block may use; >= `MIN_UB_BYTES`.
    pub ub_bytes: usize,
    /// How many blocks to cut the rows into (the plan uses `min(blocks, rows)`); >= 1.
    pub blocks: u32,
}

impl Default for UbConfig {
    fn default() -> Self {
        UbConfig {
            ub_bytes: DEFAULT_UB_BYTES,
            blocks: DEFAULT_BLOCKS,
        }
    }
}

impl UbConfig {
    /// Checks the two fields.
    pub fn validate(&self) -> Result<()> {
        if self.ub_bytes < MIN_UB_BYTES {
            return Err(invalid("ub_bytes", "must be at least 1024"));
        }
        if self.blocks == 0 {
            return Err(invalid("blocks", "must be at least 1"));
        }
        Ok(())
    }
}

/// Tiling of a row-wise normalization (RmsNorm, AddRmsNorm, RmsNormGrad).
///
/// Per block the arena holds `chunk_cols` f32 of (gamma + offset) followed by
/// `streams` tiles of `rows_per_tile * chunk_cols` f32 (one per input stream:
/// x; x1 and x2; dy, x and dres).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NormTiling {
    /// Rows M.
    pub rows: u64,
    /// Row length N (elements of gamma).
    pub cols: u64,
    /// Blocks the rows are split over (0 when there are no rows).
    pub blocks: u32,
    /// 0: merge-N (whole rows in the arena); 1: split-D (column chunks).
    pub split_d: u32,
    /// Rows per block (`ceil(rows / blocks)`); the last block may have fewer.
    pub rows_per_block: u64,
    /// Rows per arena tile (1 under split-D).
    pub rows_per_tile: u64,
    /// Columns per chunk, a multiple of 16: N rounded up to 16 under merge-N.
    pub chunk_cols: u64,
    /// f32 tiles per arena besides gamma.
    pub streams: u32,
    /// `NORM_FLAG_*` bits: hints for a backend, never changing a result bit.
    pub flags: u32,
    /// Bytes of one block's arena (<= `ub_bytes`, a multiple of 64).
    pub arena_bytes: u64,
    /// Offset of the first of `blocks` arenas from the aligned workspace
    /// start; arena `i` is at `arena_offset + i * arena_bytes`. A running
    /// block uses one arena no other running block holds (on the CPU, a
    /// slot it claims; an NPU kernel may simply use arena `b`).
    pub arena_offset: u64,
    /// Offset of the per-block f32 dgamma partials (`blocks * cols_padded`),
    /// RmsNormGrad only (else equal to the arena end).
    pub partials_offset: u64,
    /// Padded row length of the partials (N rounded up to 16).
    pub cols_padded: u64,
    /// Total workspace bytes, alignment slack included (0 when nothing is needed).
    pub workspace_bytes: u64,
}

/// `NormTiling::flags` bit: the outputs are too large to stay in a cache
/// (`STREAM_MIN_BYTES` or more), so a CPU backend writes them with streaming
/// (non-temporal) stores, which skip the read-for-ownership of the destination
/// and do not evict the inputs it still reads.
pub const NORM_FLAG_STREAM: u32 = 1;

/// `NormTiling::flags` bit: the call is small (under `SERIAL_MAX_BYTES` per
/// tensor), so a CPU backend runs its blocks on the calling thread when the
/// runner allows it (`Runner::runs_small_calls_inline`): launching a thread
/// pool costs more than it saves. The blocks, and so the bits, are the same.
pub const NORM_FLAG_SERIAL: u32 = 2;

/// Bytes of one tensor under which a plan sets `NORM_FLAG_SERIAL`: 256 KiB
/// takes about 15 us on one core, where two threads would save about 7 us
/// and a `Threads` launch on the persistent pool costs 0.3-0.8 us back to
/// back, up to about 8 us when its workers sleep (`quick --overhead`; it
/// was 1 MiB when every launch spawned threads, 90 us).
pub const SERIAL_MAX_BYTES: usize = 1 << 18;

/// Output bytes from which a plan sets `NORM_FLAG_STREAM`: beyond a
/// last-level cache share (server LLCs hold 1.5-3 MiB per core; an output of
/// 8 MiB written by one call will not be read back from cache).
pub const STREAM_MIN_BYTES: usize = 8 << 20;

/// What a caller knows about the pages of a call's output buffers: the
/// input of the store policy (`Exec::outputs`, `npk_exec.backend`'s
/// `NPK_OUTPUTS_*` bits). It decides only how large outputs are stored,
/// never a result bit: a wrong hint costs time, nothing else. The rule and
/// its measurements: `docs/performance.md`, "Store policy".
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OutputPages {
    /// Nothing known: outputs of `STREAM_MIN_BYTES` or more are streamed,
    /// as for `Resident` (on resident pages streaming saves up to 45%; on
    /// fresh 4 KiB pages it costs 3-15%).
    #[default]
    Unknown,
    /// Just allocated and not yet written, on 4 KiB pages (a new `mmap`:
    /// the OS faults and zeroes each page through the cache on its first
    /// touch): ordinary stores, which overwrite those zeroed lines in cache
    /// instead of sending the page to memory twice. EmbeddingDenseGrad,
    /// whose zero fill is measured faster streamed even there, still
    /// streams.
    Fresh,
    /// Written before and still mapped (a reused buffer, a caching
    /// allocator's block), or fresh but on huge pages: outputs of
    /// `STREAM_MIN_BYTES` or more are streamed.
    Resident,
}

impl OutputPages {
    /// Whether large outputs (a plan's `NORM_FLAG_STREAM` as cut from the
    /// shapes) are written with streaming stores under this hint, for an
    /// operator that writes fresh pages faster with ordinary stores (every
    /// one but EmbeddingDenseGrad).
    pub const fn stream(self, large: bool) -> bool {
        self.stream_op(large, false)
    }

    /// `stream`, for an operator that streams into fresh pages too when
    /// `fresh_streams`.
    pub(crate) const fn stream_op(self, large: bool, fresh_streams: bool) -> bool {
        match self {
            OutputPages::Unknown | OutputPages::Resident => large,
            OutputPages::Fresh => large && fresh_streams,
        }
    }

    /// `flags` (a plan's `NORM_FLAG_*` bits) with `NORM_FLAG_STREAM` as
    /// this hint decides (see `stream_op`).
    pub(crate) const fn apply(self, flags: u32, fresh_streams: bool) -> u32 {
        if self.stream_op(flags & NORM_FLAG_STREAM != 0, fresh_streams) {
            flags | NORM_FLAG_STREAM
        } else {
            flags & !NORM_FLAG_STREAM
        }
    }
}

fn round_up(n: usize, m: usize) -> Option<usize> {
    n.checked_add(m - 1).map(|v| v / m * m)
}

impl NormTiling {
    /// Plans `rows` x `cols` elements of `elem_bytes` bytes with `streams`
    /// input tiles; `partials` adds the dgamma partials region.
    pub fn new(
        rows: usize,
        cols: usize,
        elem_bytes: usize,
        streams: usize,
        partials: bool,
        cfg: &UbConfig,
    ) -> Result<NormTiling> {
        cfg.validate()?;
        let ovf = Error::SizeOverflow { arg: "workspace" };
        let cols_padded = round_up(cols, GROUP).ok_or(ovf)?;
        let mut t = NormTiling {
            rows: rows as u64,
            cols: cols as u64,
            cols_padded: cols_padded as u64,
            streams: streams as u32,
            ..Default::default()
        };
        if rows == 0 {
            return Ok(t);
        }
        // Bytes of one input tensor (saturating: only compared with limits).
        let tensor_bytes = rows.saturating_mul(cols).saturating_mul(elem_bytes);
        // Every dtype streams (the CPU kernels store whole lines: two groups
        // of a 16-bit row, one of f32).
        if tensor_bytes >= STREAM_MIN_BYTES {
            t.flags |= NORM_FLAG_STREAM;
        }
        if tensor_bytes < SERIAL_MAX_BYTES {
            t.flags |= NORM_FLAG_SERIAL;
        }
        let blocks0 = (cfg.blocks as usize).min(rows);
        let rows_per_block = rows.div_ceil(blocks0);
        let blocks = rows.div_ceil(rows_per_block);
        t.blocks = blocks as u32;
        t.rows_per_block = rows_per_block as u64;
        if cols_padded == 0 {
            // Rows of length 0 write at most their rstd: no arena, no
            // partials, no workspace.
            t.rows_per_tile = rows_per_block as u64;
            return Ok(t);
        }

        let ub = cfg.ub_bytes / WORKSPACE_ALIGN * WORKSPACE_ALIGN;
        let floats = ub / 4;
        let (split, rpt, chunk) = if (1 + streams)
            .checked_mul(cols_padded)
            .is_some_and(|need| need <= floats)
        {
            let rpt = (floats - cols_padded) / (streams * cols_padded);
            (false, rpt.clamp(1, rows_per_block), cols_padded)
        } else {
            let chunk = floats / (1 + streams) / GROUP * GROUP;
            if chunk == 0 {
                return Err(invalid("ub_bytes", "too small for one 16-element chunk"));
            }
            (true, 1, chunk)
        };
        t.split_d = split as u32;
        t.rows_per_tile = rpt as u64;
        t.chunk_cols = chunk as u64;
        // arena = gamma chunk + streams tiles, rounded to the alignment.
        let arena_floats = rpt
            .checked_mul(chunk)
            .and_then(|v| v.checked_mul(streams))
            .and_then(|v| v.checked_add(chunk))
            .ok_or(ovf)?;
        let arena_bytes = arena_floats
            .checked_mul(4)
            .and_then(|b| round_up(b.max(WORKSPACE_ALIGN), WORKSPACE_ALIGN))
            .ok_or(ovf)?;
        t.arena_bytes = arena_bytes as u64;
        t.arena_offset = 0;
        let arenas = blocks.checked_mul(arena_bytes).ok_or(ovf)?;
        t.partials_offset = arenas as u64;
        let partial_bytes = if partials {
            cols_padded
                .checked_mul(4)
                .and_then(|b| b.checked_mul(blocks))
                .ok_or(ovf)?
        } else {
            0
        };
        let total = arenas
            .checked_add(partial_bytes)
            .and_then(|b| b.checked_add(WORKSPACE_ALIGN))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(ovf)?;
        t.workspace_bytes = total as u64;
        Ok(t)
    }

    /// The rows `[start, end)` of block `b`.
    pub fn block_rows(&self, b: usize) -> (usize, usize) {
        let rpb = self.rows_per_block as usize;
        let start = (b * rpb).min(self.rows as usize);
        let end = (start + rpb).min(self.rows as usize);
        (start, end)
    }
}

/// The aligned start of a workspace: the offset into `ws` at which the plan's
/// offsets begin.
pub(crate) fn align_offset(ptr: *const u8) -> usize {
    (WORKSPACE_ALIGN - (ptr as usize) % WORKSPACE_ALIGN) % WORKSPACE_ALIGN
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_n_and_split_d() {
        let cfg = UbConfig::default();
        let t = NormTiling::new(1000, 4096, 2, 1, false, &cfg).unwrap();
        assert_eq!(t.split_d, 0);
        assert_eq!(t.blocks, 63); // ceil(1000/64) = 16 rows per block -> 63 blocks
        assert!(t.rows_per_tile >= 2);
        assert!(t.arena_bytes as usize <= cfg.ub_bytes);
        let t = NormTiling::new(4, 110_000, 2, 3, true, &cfg).unwrap();
        assert_eq!(t.flags, 0); // 0.9 MB: over SERIAL_MAX_BYTES, cached stores
        let t = NormTiling::new(4, 16_000, 2, 3, true, &cfg).unwrap();
        assert_eq!(t.flags, NORM_FLAG_SERIAL); // 128 KB: the calling thread
        assert_eq!(t.split_d, 1);
        assert_eq!(t.chunk_cols % 16, 0);
        assert!(t.arena_bytes as usize <= cfg.ub_bytes);
    }

    #[test]
    fn large_outputs_stream() {
        let cfg = UbConfig::default();
        let t = NormTiling::new(2048, 4096, 4, 1, false, &cfg).unwrap();
        assert_eq!((t.blocks, t.flags), (64, NORM_FLAG_STREAM));
        let t = NormTiling::new(2048, 4096, 2, 1, false, &cfg).unwrap();
        assert_eq!(t.flags, NORM_FLAG_STREAM); // 16 MiB of bf16
        let t = NormTiling::new(1024, 4096, 2, 1, false, &cfg).unwrap();
        assert_eq!(t.flags, NORM_FLAG_STREAM); // exactly 8 MiB
        let t = NormTiling::new(1, 4096, 2, 1, false, &cfg).unwrap();
        assert_eq!(t.flags, NORM_FLAG_SERIAL); // 8 KiB: not worth a launch
        let t = NormTiling::new(128, 4096, 2, 1, false, &cfg).unwrap();
        assert_eq!(t.flags, 0); // exactly 1 MiB
        assert_eq!(
            NormTiling::new(1024, 4095, 2, 1, false, &cfg)
                .unwrap()
                .flags,
            0
        );
    }

    #[test]
    fn overflow_is_an_error() {
        let cfg = UbConfig::default();
        assert!(NormTiling::new(usize::MAX / 2, usize::MAX / 2, 2, 1, true, &cfg).is_err());
    }
}

/// Tiling of EmbeddingDenseGrad (the TilingData of `npk_embedding_dense_grad_call`).
///
/// Workspace layout from the aligned start: `num_weights + 1` u32 row offsets
/// (the counting sort's prefix sums), then `positions` u32 positions sorted by
/// row, then one f32 arena of `chunk_cols` per block. The sort regions are
/// sized for the worst case (every position in range), so the size depends on
/// shapes alone. Rows are split over blocks by work at run time (see
/// `ops::embedding_dense_grad`); the plan fixes only how many blocks there are.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EmbeddingTiling {
    /// Positions N (elements of indices).
    pub positions: u64,
    /// Row length H (grad's last dim).
    pub cols: u64,
    /// Rows of the output table.
    pub num_weights: u64,
    /// Blocks the rows are split over (`min(blocks, num_weights)`); 0 when
    /// nothing is written (`cols == 0` or `num_weights == 0`).
    pub blocks: u32,
    /// `NORM_FLAG_STREAM` when the table is 8 MiB or more
    /// (`STREAM_MIN_BYTES`, counted at grad's element size): a CPU backend
    /// writes its zero fill and copied rows with streaming stores.
    pub flags: u32,
    /// Columns per f32 tile, a multiple of 16: H rounded up to 16 when that
    /// fits the UB, else the largest multiple of 16 that does (split-D).
    pub chunk_cols: u64,
    /// Bytes of one block's arena (<= `ub_bytes`, a multiple of 64).
    pub arena_bytes: u64,
    /// Offset of the `num_weights + 1` u32 row offsets.
    pub offsets_offset: u64,
    /// Offset of the `positions` u32 sorted positions.
    pub order_offset: u64,
    /// Offset of the first of `blocks` arenas; arena `i` is at
    /// `arena_offset + i * arena_bytes` (one per running block, as for
    /// `NormTiling::arena_offset`).
    pub arena_offset: u64,
    /// Total workspace bytes, alignment slack included (0 when nothing is needed).
    pub workspace_bytes: u64,
}

impl EmbeddingTiling {
    /// Plans `positions` gradient rows of `cols` elements (of `elem_bytes`
    /// bytes) into a table of `num_weights` rows. Positions are stored as u32, so more than
    /// `u32::MAX` of them is a `SizeOverflow` (when anything is written).
    pub fn new(
        positions: usize,
        cols: usize,
        num_weights: usize,
        elem_bytes: usize,
        cfg: &UbConfig,
    ) -> Result<EmbeddingTiling> {
        cfg.validate()?;
        let ovf = Error::SizeOverflow { arg: "workspace" };
        let mut t = EmbeddingTiling {
            positions: positions as u64,
            cols: cols as u64,
            num_weights: num_weights as u64,
            ..Default::default()
        };
        if cols == 0 || num_weights == 0 {
            return Ok(t);
        }
        if u32::try_from(positions).is_err() {
            return Err(Error::SizeOverflow { arg: "indices" });
        }
        if num_weights.saturating_mul(cols).saturating_mul(elem_bytes) >= STREAM_MIN_BYTES {
            t.flags |= NORM_FLAG_STREAM;
        }
        let blocks = (cfg.blocks as usize).min(num_weights);
        let floats = cfg.ub_bytes / WORKSPACE_ALIGN * WORKSPACE_ALIGN / 4;
        let chunk = round_up(cols, GROUP)
            .ok_or(ovf)?
            .min(floats / GROUP * GROUP);
        if chunk == 0 {
            return Err(invalid("ub_bytes", "too small for one 16-element chunk"));
        }
        let arena_bytes = round_up(chunk * 4, WORKSPACE_ALIGN).ok_or(ovf)?;
        let offsets_bytes = num_weights
            .checked_add(1)
            .and_then(|n| n.checked_mul(4))
            .and_then(|b| round_up(b, WORKSPACE_ALIGN))
            .ok_or(ovf)?;
        let order_bytes = positions
            .checked_mul(4)
            .and_then(|b| round_up(b, WORKSPACE_ALIGN))
            .ok_or(ovf)?;
        let arena_offset = offsets_bytes.checked_add(order_bytes).ok_or(ovf)?;
        let total = blocks
            .checked_mul(arena_bytes)
            .and_then(|b| b.checked_add(arena_offset))
            .and_then(|b| b.checked_add(WORKSPACE_ALIGN))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or(ovf)?;
        t.blocks = blocks as u32;
        t.chunk_cols = chunk as u64;
        t.arena_bytes = arena_bytes as u64;
        t.offsets_offset = 0;
        t.order_offset = offsets_bytes as u64;
        t.arena_offset = arena_offset as u64;
        t.workspace_bytes = total as u64;
        Ok(t)
    }
}

/// Tiling of an elementwise operator (SwiGLU, RoPE): `rows` rows of `cols`
/// elements, cut into units of `rows_per_unit` rows by `chunk_cols`
/// columns — the tile one Unified Buffer holds, `streams` f32 tiles of it.
/// Units, in row-major order, are split evenly over `blocks`. Elementwise
/// operators need no workspace: `workspace_bytes` is 0, kept so every plan
/// answers the two-phase size call the same way.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EltTiling {
    /// Rows.
    pub rows: u64,
    /// Elements per row.
    pub cols: u64,
    /// Rows per unit (1 when a row is cut into chunks).
    pub rows_per_unit: u64,
    /// Columns per unit: `cols` when whole rows fit, else a multiple of 32.
    pub chunk_cols: u64,
    /// Units per row group (`ceil(cols / chunk_cols)`).
    pub chunks_per_row: u64,
    /// All units: `ceil(rows / rows_per_unit) * chunks_per_row`.
    pub units: u64,
    /// Units per block (`ceil(units / blocks)`); the last block may have fewer.
    pub units_per_block: u64,
    /// Blocks (0 when there is nothing to do).
    pub blocks: u32,
    /// f32 tiles per unit the UB must hold (inputs and outputs).
    pub streams: u32,
    /// `NORM_FLAG_STREAM` / `NORM_FLAG_SERIAL`, as for the norms: hints that
    /// never change a result bit.
    pub flags: u32,
    /// Zero.
    pub reserved: u32,
    /// Always 0.
    pub workspace_bytes: u64,
}

/// One unit of an `EltTiling`: rows `row..row + rows`, columns `col..col + cols`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EltUnit {
    /// First row.
    pub row: usize,
    /// Rows in the unit.
    pub rows: usize,
    /// First column.
    pub col: usize,
    /// Columns in the unit.
    pub cols: usize,
}

impl EltTiling {
    /// Plans `rows` x `cols` elements with `streams` f32 tiles per unit;
    /// `whole_rows` keeps rows uncut (RoPE pairs column j with j + cols/2).
    /// `in_bytes` / `out_bytes` size the largest input and the output (for
    /// the serial and streaming hints).
    pub fn new(
        rows: usize,
        cols: usize,
        streams: usize,
        whole_rows: bool,
        in_bytes: usize,
        out_bytes: usize,
        cfg: &UbConfig,
    ) -> Result<EltTiling> {
        cfg.validate()?;
        let mut t = EltTiling {
            rows: rows as u64,
            cols: cols as u64,
            streams: streams as u32,
            ..Default::default()
        };
        if rows == 0 || cols == 0 {
            return Ok(t);
        }
        let cap = (cfg.ub_bytes / (streams.max(1) * 4) / (2 * GROUP) * (2 * GROUP)).max(2 * GROUP);
        let (chunk, per_unit) = if whole_rows || cols <= cap {
            let padded = round_up(cols, GROUP).ok_or(Error::SizeOverflow { arg: "cols" })?;
            (cols, (cap / padded).max(1))
        } else {
            (cap, 1)
        };
        t.chunk_cols = chunk as u64;
        t.rows_per_unit = per_unit.min(rows) as u64;
        t.chunks_per_row = cols.div_ceil(chunk) as u64;
        let units = rows.div_ceil(per_unit.min(rows)) * cols.div_ceil(chunk);
        t.units = units as u64;
        let blocks0 = (cfg.blocks as usize).min(units);
        let upb = units.div_ceil(blocks0);
        t.units_per_block = upb as u64;
        t.blocks = units.div_ceil(upb) as u32;
        if out_bytes >= STREAM_MIN_BYTES {
            t.flags |= NORM_FLAG_STREAM;
        }
        if in_bytes < SERIAL_MAX_BYTES {
            t.flags |= NORM_FLAG_SERIAL;
        }
        Ok(t)
    }

    /// The units of block `b`: `start..end`.
    pub fn block_units(&self, b: usize) -> (usize, usize) {
        let upb = self.units_per_block as usize;
        let start = (b * upb).min(self.units as usize);
        (start, (start + upb).min(self.units as usize))
    }

    /// Unit `u` (< `units`).
    pub fn unit(&self, u: usize) -> EltUnit {
        let cpr = (self.chunks_per_row as usize).max(1);
        let (g, c) = (u / cpr, u % cpr);
        let rpu = self.rows_per_unit as usize;
        let row = g * rpu;
        let col = c * self.chunk_cols as usize;
        EltUnit {
            row,
            rows: rpu.min((self.rows as usize).saturating_sub(row)),
            col,
            cols: (self.chunk_cols as usize).min((self.cols as usize).saturating_sub(col)),
        }
    }
}
