//! The C ABI with arbitrary descriptors and exec structs: NULL anywhere, any
//! ndim / shape / dtype code, overlapping and misaligned buffers, any
//! workspace size and placement, misbehaving runners and the foreign backend.
//!
//! Every buffer (tensor data, workspace, the error detail, the out-structs)
//! is placed in one guarded arena; after each call the arena is compared with
//! its snapshot. Checked:
//! - every call returns a known status, and the detail (when given) repeats it;
//! - the size call and the run call agree on validation failures;
//! - an error changes no byte of any tensor (only the detail, and workspace
//!   bytes that belong to no tensor), unless a runner broke its contract;
//! - a success changes no byte outside outputs, workspace and detail, and no
//!   byte of a pure input;
//! - a runner that skipped, repeated or misnumbered blocks never gets `NPK_OK`;
//! - a foreign backend gets a call whose tensors and workspace are the
//!   caller's, and its failure code comes back as `NPK_ERR_BACKEND`.
//!
//! Run: `cargo +nightly fuzz run capi`, or the stable recipe in
//! `scripts/fuzz_smoke.sh`.
#![no_main]
// Descriptors and option structs are boxed so that their addresses (held by
// the call closures as raw pointers) survive the Vec growing.
#![allow(clippy::vec_box, clippy::needless_late_init)]

use core::ffi::c_void;
use libfuzzer_sys::fuzz_target;
use npukern::{AddRmsNormCall, EmbeddingDenseGradCall, RawTensor, RmsNormCall, RmsNormGradCall};
use npukern_fuzz::{dims, Bytes};

// ---- the C ABI, declared from include/npukern.h ----

#[repr(C)]
#[derive(Clone, Copy)]
struct Tensor {
    data: *mut c_void,
    dtype: u32,
    ndim: u32,
    shape: [i64; 8],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Detail {
    status: i32,
    argument: [u8; 32],
    position: i64,
    value: i64,
    message: [u8; 160],
}

type TaskFn = Option<unsafe extern "C" fn(*mut c_void, usize)>;
type ParallelFor = Option<unsafe extern "C" fn(*mut c_void, usize, TaskFn, *mut c_void)>;

#[repr(C)]
struct Exec {
    ub_bytes: u64,
    blocks: u32,
    isa: u32,
    backend: u32,
    parallel_for: ParallelFor,
    runner_ctx: *mut c_void,
    foreign: *const Foreign,
    detail: *mut Detail,
}

#[repr(C)]
struct Foreign {
    struct_size: usize,
    ctx: *mut c_void,
    rms_norm: Option<unsafe extern "C" fn(*mut c_void, *const RmsNormCall) -> i32>,
    add_rms_norm: Option<unsafe extern "C" fn(*mut c_void, *const AddRmsNormCall) -> i32>,
    rms_norm_grad: Option<unsafe extern "C" fn(*mut c_void, *const RmsNormGradCall) -> i32>,
    embedding_dense_grad:
        Option<unsafe extern "C" fn(*mut c_void, *const EmbeddingDenseGradCall) -> i32>,
}

#[repr(C)]
struct NormOpts {
    eps: f64,
    gamma_offset: f32,
    rounding: u32,
}

#[repr(C)]
struct GradOpts {
    gamma_offset: f32,
    accumulate_dgamma: u8,
}

#[repr(C)]
struct EmbOpts {
    padding_idx: i64,
    scale_grad_by_freq: u8,
    vocab_start: i64,
    out_of_range: u32,
    accumulate: u8,
}

#[repr(C)]
struct Summary {
    sum_sq: f64,
    nan_count: u64,
    inf_count: u64,
    min: f32,
    max: f32,
    absmax: f32,
}

type T = *const Tensor;
extern "C" {
    fn npk_rms_norm_workspace_size(
        x: T,
        g: T,
        o: *const NormOpts,
        e: *const Exec,
        ws: *mut usize,
    ) -> i32;
    fn npk_rms_norm(
        x: T,
        g: T,
        o: *const NormOpts,
        y: T,
        r: T,
        w: *mut c_void,
        wb: usize,
        e: *const Exec,
    ) -> i32;
    fn npk_add_rms_norm_workspace_size(
        x1: T,
        x2: T,
        g: T,
        o: *const NormOpts,
        e: *const Exec,
        ws: *mut usize,
    ) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn npk_add_rms_norm(
        x1: T,
        x2: T,
        g: T,
        o: *const NormOpts,
        y: T,
        r: T,
        s: T,
        w: *mut c_void,
        wb: usize,
        e: *const Exec,
    ) -> i32;
    fn npk_rms_norm_grad_workspace_size(
        dy: T,
        x: T,
        r: T,
        g: T,
        o: *const GradOpts,
        e: *const Exec,
        ws: *mut usize,
    ) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn npk_rms_norm_grad(
        dy: T,
        x: T,
        r: T,
        g: T,
        dres: T,
        o: *const GradOpts,
        dx: T,
        dg: T,
        dgc: T,
        w: *mut c_void,
        wb: usize,
        e: *const Exec,
    ) -> i32;
    fn npk_embedding_dense_grad_workspace_size(
        g: T,
        i: T,
        nw: u64,
        o: *const EmbOpts,
        e: *const Exec,
        ws: *mut usize,
    ) -> i32;
    fn npk_embedding_dense_grad(
        g: T,
        i: T,
        nw: u64,
        o: *const EmbOpts,
        out: T,
        w: *mut c_void,
        wb: usize,
        e: *const Exec,
    ) -> i32;
    fn npk_grad_stats_workspace_size(t: T, n: usize, e: *const Exec, ws: *mut usize) -> i32;
    fn npk_grad_stats(
        t: T,
        n: usize,
        out: *mut Summary,
        w: *mut c_void,
        wb: usize,
        e: *const Exec,
    ) -> i32;
    #[allow(clippy::too_many_arguments)]
    fn npk_clip_grad_norm(
        t: T,
        n: usize,
        max_norm: f64,
        err: u8,
        total: *mut f64,
        w: *mut c_void,
        wb: usize,
        e: *const Exec,
    ) -> i32;
    fn npk_threads_parallel_for(ctx: *mut c_void, n: usize, task: TaskFn, task_ctx: *mut c_void);
    fn npk_status_string(s: i32) -> *const u8;
    fn npk_version() -> *const u8;
    fn npk_detected_isa() -> u32;
}

const _: () = assert!(size_of::<Tensor>() == size_of::<RawTensor>());

const OK: i32 = 0;
const ERR_BACKEND: i32 = 361001;
const STATUSES: [i32; 10] = [
    0, 161001, 161002, 161003, 161004, 161005, 161006, 161007, 161008, 361001,
];

// ---- the guarded arena ----

/// Bytes at each end of the arena that no buffer is placed in.
const GUARD: usize = 64;
/// Arena size: bounds every tensor (and so the fuzzer's memory).
const ARENA: usize = 1 << 15;
/// Most elements of one tensor family (x, y, ...): 2048 x 4 bytes = ARENA / 4.
const CAP: usize = 2048;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    In,
    Out,
    InOut,
    Workspace,
    Detail,
    /// The size call's `size_t`, the summary, total_norm.
    Result,
}

#[derive(Clone, Copy, Debug)]
struct Range {
    start: usize,
    len: usize,
    role: Role,
}

impl Range {
    fn contains(&self, o: usize) -> bool {
        o >= self.start && o < self.start + self.len
    }
}

struct Arena {
    mem: Vec<u64>,
    ranges: Vec<Range>,
}

impl Arena {
    fn new(b: &mut Bytes<'_>) -> Arena {
        // A xorshift block repeated (copies, not per-word code: the
        // instrumented loop would dominate the run): arbitrary floats and
        // indices everywhere.
        let mut s = b.u64() | 1;
        let block: Vec<u64> = (0..61)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s
            })
            .collect();
        let mut mem = Vec::with_capacity(ARENA / 8);
        while mem.len() < ARENA / 8 {
            let k = (ARENA / 8 - mem.len()).min(block.len());
            mem.extend_from_slice(&block[..k]);
        }
        Arena {
            mem,
            ranges: Vec::new(),
        }
    }

    fn base(&mut self) -> *mut u8 {
        self.mem.as_mut_ptr().cast()
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: a u64 buffer viewed as its bytes.
        unsafe { core::slice::from_raw_parts(self.mem.as_ptr().cast(), ARENA) }
    }

    /// An offset for `len` bytes aligned to `align`: fresh, or (sometimes)
    /// overlapping an earlier buffer, or (sometimes) misaligned by one.
    fn place(&mut self, b: &mut Bytes<'_>, len: usize, align: usize, role: Role) -> usize {
        let room = ARENA - 2 * GUARD;
        // Every descriptor the library may accept must fit (a clamped range
        // would let it run past the arena).
        assert!(
            len <= room,
            "harness: a {len}-byte buffer does not fit the arena"
        );
        let mut off = match b.u8() % 16 {
            0 if !self.ranges.is_empty() => {
                let r = self.ranges[b.below(self.ranges.len())];
                r.start + b.below(r.len.max(1))
            }
            1 if !self.ranges.is_empty() => self.ranges[b.below(self.ranges.len())].start,
            _ => GUARD + b.u16() as usize % (room - len + 1),
        };
        off = off / align * align;
        if b.one_in(32) {
            off += 1;
        }
        let off = off.clamp(GUARD, ARENA - GUARD - len);
        self.ranges.push(Range {
            start: off,
            len,
            role,
        });
        off
    }
}

// ---- descriptors ----

fn elem_size(dtype: u32) -> Option<usize> {
    match dtype {
        0 | 3 => Some(4),
        1 | 2 => Some(2),
        4 => Some(8),
        _ => None,
    }
}

/// A descriptor of `dims` / `dtype` with its data in the arena (with rare
/// mutations: NULL data, another dtype code, a bad rank, a negative or
/// overflowing dim, one dim shorter). The arena range placed is exactly the
/// extent the descriptor describes when that is valid; otherwise the library
/// must reject it before reading. Returns the descriptor (owned by `store`)
/// or NULL.
fn tensor(
    b: &mut Bytes<'_>,
    a: &mut Arena,
    store: &mut Vec<Box<Tensor>>,
    dims: &[usize],
    dtype: u32,
    role: Role,
) -> *const Tensor {
    if b.one_in(64) {
        return core::ptr::null();
    }
    let mut t = Tensor {
        data: core::ptr::null_mut(),
        dtype,
        ndim: dims.len() as u32,
        shape: [0; 8],
    };
    for (s, &d) in t.shape.iter_mut().zip(dims) {
        *s = d as i64;
    }
    if b.one_in(24) {
        t.dtype = if b.bool() { b.below(6) as u32 } else { b.u32() };
    }
    if b.one_in(24) {
        let i = b.below(8);
        match b.u8() % 5 {
            0 => t.ndim = b.pick(&[0, 9, u32::MAX, 8]),
            1 => t.shape[i] = -1 - b.below(3) as i64,
            2 => t.shape[i] = i64::MIN,
            3 => {
                // Overflow: every dim huge (product far past isize::MAX).
                for s in t.shape.iter_mut() {
                    *s = i64::MAX - b.below(2) as i64;
                }
                t.ndim = 2 + b.below(7) as u32;
            }
            _ => {
                if let Some(s) = t.shape[..dims.len()].iter_mut().find(|s| **s > 0) {
                    *s -= 1;
                }
            }
        }
    }
    let numel: usize = dims.iter().product();
    let size = elem_size(t.dtype).unwrap_or(4);
    let bytes = described_bytes(&t).unwrap_or(numel * size);
    if bytes > 0 || b.one_in(4) {
        let off = a.place(b, bytes, size, role);
        t.data = a.base().wrapping_add(off).cast();
    }
    if b.one_in(48) {
        t.data = core::ptr::null_mut();
    }
    store.push(Box::new(t));
    &**store.last().unwrap()
}

/// The bytes a descriptor describes, when it is one the library accepts
/// (and small enough to place).
fn described_bytes(t: &Tensor) -> Option<usize> {
    let size = elem_size(t.dtype)?;
    if t.ndim == 0 || t.ndim > 8 {
        return None;
    }
    let mut n: u128 = size as u128;
    for &d in &t.shape[..t.ndim as usize] {
        n = n.saturating_mul(u128::try_from(d).ok()?);
    }
    (n <= (ARENA / 2) as u128).then_some(n as usize)
}

// ---- runners ----

/// How the fuzz runner breaks (or keeps) the contract.
struct RunnerCtx {
    mode: u8,
    /// Set when the blocks run were not exactly 0..n once each.
    deviated: bool,
}

unsafe extern "C" fn fuzz_runner(ctx: *mut c_void, n: usize, task: TaskFn, task_ctx: *mut c_void) {
    // SAFETY: our own RunnerCtx, alive for the call.
    let r = unsafe { &mut *(ctx as *mut RunnerCtx) };
    let Some(task) = task else {
        r.deviated = true;
        return;
    };
    // SAFETY (all calls below): the library's task and context, as handed to us.
    let run = |b: usize| unsafe { task(task_ctx, b) };
    match r.mode % 8 {
        0 => (0..n).for_each(run),
        1 => (0..n).rev().for_each(run),
        2 => {
            // Skip the last block.
            (0..n.saturating_sub(1)).for_each(run);
            r.deviated |= n > 0;
        }
        3 => {
            // Block 0 twice.
            (0..n).for_each(run);
            if n > 0 {
                run(0);
                r.deviated = true;
            }
        }
        4 => {
            // A block number out of range, then the real ones.
            run(n);
            (0..n).for_each(run);
            r.deviated = true;
        }
        5 => {
            // Block 0 in place of block n-1: the count is right, the set is not.
            (0..n.saturating_sub(1)).for_each(run);
            if n > 0 {
                run(0);
                r.deviated |= n > 1;
            }
        }
        6 => {
            // Two threads, interleaved blocks.
            let tc = task_ctx as usize;
            std::thread::scope(|s| {
                for t in 0..2 {
                    s.spawn(move || {
                        for blk in (t..n).step_by(2) {
                            // SAFETY: as above; the task is Sync per the contract.
                            unsafe { task(tc as *mut c_void, blk) };
                        }
                    });
                }
            });
        }
        _ => {
            r.deviated |= n > 0;
        }
    }
}

// ---- the foreign backend ----

struct ForeignCtx {
    /// 0: write every output and return OK; otherwise return this code.
    code: i32,
    /// Set when an entry ran.
    called: bool,
    /// The caller's workspace, which the call must carry.
    ws: (*mut c_void, usize),
    /// Arena bounds: every tensor in the call must lie inside.
    arena: (usize, usize),
    /// The check failed (reported after the call).
    bad: Option<&'static str>,
    /// Entries the table's struct_size covers.
    entries: usize,
}

fn extent(t: &RawTensor) -> usize {
    let n: usize = t.shape[..t.ndim as usize]
        .iter()
        .map(|&d| d as usize)
        .product();
    n * elem_size(t.dtype as u32).unwrap()
}

impl ForeignCtx {
    fn check(&mut self, ts: &[&RawTensor], ws: *mut c_void, wb: usize, need: u64) {
        self.called = true;
        for t in ts {
            let (p, n) = (t.data as usize, extent(t));
            if n > 0 && (p < self.arena.0 || p + n > self.arena.1) {
                self.bad = Some("a tensor of the call is not the caller's");
            }
        }
        if (ws, wb) != self.ws {
            self.bad = Some("the call's workspace is not the caller's");
        }
        if need > wb as u64 {
            self.bad = Some("the plan needs more workspace than was given");
        }
    }

    /// Writes the outputs (as the call describes them) when succeeding.
    fn finish(&self, outs: &[&RawTensor]) -> i32 {
        if self.code == 0 && self.bad.is_none() {
            for t in outs {
                // SAFETY: the call's output, checked to be inside the arena.
                unsafe { core::ptr::write_bytes(t.data.cast::<u8>(), 0x5a, extent(t)) };
            }
        }
        self.code
    }
}

/// Which outputs a call carries.
fn outs(list: [(&RawTensor, bool); 3]) -> Vec<&RawTensor> {
    list.into_iter()
        .filter(|(_, on)| *on)
        .map(|(t, _)| t)
        .collect()
}

unsafe extern "C" fn f_rms_norm(ctx: *mut c_void, c: *const RmsNormCall) -> i32 {
    // SAFETY: our ctx and the library's call, alive for the call.
    let (f, c) = unsafe { (&mut *(ctx as *mut ForeignCtx), &*c) };
    if 0 >= f.entries {
        f.bad = Some("an entry beyond the table's struct_size was called");
    }
    f.check(
        &[&c.x, &c.gamma, &c.y, &c.rstd],
        c.workspace,
        c.workspace_bytes,
        c.tiling.workspace_bytes,
    );
    f.finish(&outs([
        (&c.y, true),
        (&c.rstd, c.has_rstd != 0),
        (&c.y, false),
    ]))
}

unsafe extern "C" fn f_add_rms_norm(ctx: *mut c_void, c: *const AddRmsNormCall) -> i32 {
    // SAFETY: as above.
    let (f, c) = unsafe { (&mut *(ctx as *mut ForeignCtx), &*c) };
    if 1 >= f.entries {
        f.bad = Some("an entry beyond the table's struct_size was called");
    }
    f.check(
        &[&c.x1, &c.x2, &c.gamma, &c.y, &c.rstd, &c.x_sum],
        c.workspace,
        c.workspace_bytes,
        c.tiling.workspace_bytes,
    );
    f.finish(&outs([
        (&c.y, true),
        (&c.rstd, c.has_rstd != 0),
        (&c.x_sum, c.has_x_sum != 0),
    ]))
}

unsafe extern "C" fn f_rms_norm_grad(ctx: *mut c_void, c: *const RmsNormGradCall) -> i32 {
    // SAFETY: as above.
    let (f, c) = unsafe { (&mut *(ctx as *mut ForeignCtx), &*c) };
    if 2 >= f.entries {
        f.bad = Some("an entry beyond the table's struct_size was called");
    }
    f.check(
        &[
            &c.dy,
            &c.x,
            &c.rstd,
            &c.gamma,
            &c.dres,
            &c.dx,
            &c.dgamma,
            &c.dgamma_cast,
        ],
        c.workspace,
        c.workspace_bytes,
        c.tiling.workspace_bytes,
    );
    f.finish(&outs([
        (&c.dx, true),
        (&c.dgamma, c.has_dgamma != 0),
        (&c.dgamma_cast, c.has_dgamma_cast != 0),
    ]))
}

unsafe extern "C" fn f_embedding(ctx: *mut c_void, c: *const EmbeddingDenseGradCall) -> i32 {
    // SAFETY: as above.
    let (f, c) = unsafe { (&mut *(ctx as *mut ForeignCtx), &*c) };
    if 3 >= f.entries {
        f.bad = Some("an entry beyond the table's struct_size was called");
    }
    f.check(
        &[&c.grad, &c.indices, &c.out],
        c.workspace,
        c.workspace_bytes,
        c.tiling.workspace_bytes,
    );
    f.finish(&outs([(&c.out, true), (&c.out, false), (&c.out, false)]))
}

// ---- one case ----

struct Case {
    arena: Arena,
    tensors: Vec<Box<Tensor>>,
    runner: Box<RunnerCtx>,
    foreign_ctx: Box<ForeignCtx>,
    foreign: Box<Foreign>,
    exec: Box<Exec>,
    exec_null: bool,
    threads: Box<u32>,
    detail_local: Box<Detail>,
    result_local: Box<[u64; 8]>,
    /// A deliberately broken contract (runner or foreign) makes an error's
    /// partial writes to outputs legitimate.
    misbehaving: bool,
}

impl Case {
    fn exec_ptr(&self) -> *const Exec {
        if self.exec_null {
            core::ptr::null()
        } else {
            &*self.exec
        }
    }

    /// A pointer for a small result struct: NULL, a local, or arena bytes
    /// (possibly misaligned, possibly over a tensor).
    fn result_ptr(&mut self, b: &mut Bytes<'_>, len: usize, role: Role) -> *mut c_void {
        match b.u8() % 16 {
            0 => core::ptr::null_mut(),
            1..=3 => {
                let off = self.arena.place(b, len, 8, role);
                self.arena.base().wrapping_add(off).cast()
            }
            _ => self.result_local.as_mut_ptr().cast(),
        }
    }
}

fn build_exec(b: &mut Bytes<'_>, a: Arena) -> Case {
    let mut c = Case {
        arena: a,
        tensors: Vec::new(),
        runner: Box::new(RunnerCtx {
            mode: 0,
            deviated: false,
        }),
        foreign_ctx: Box::new(ForeignCtx {
            code: 0,
            called: false,
            ws: (core::ptr::null_mut(), 0),
            arena: (0, 0),
            bad: None,
            entries: 4,
        }),
        foreign: Box::new(Foreign {
            struct_size: size_of::<Foreign>(),
            ctx: core::ptr::null_mut(),
            rms_norm: None,
            add_rms_norm: None,
            rms_norm_grad: None,
            embedding_dense_grad: None,
        }),
        exec: Box::new(Exec {
            ub_bytes: 0,
            blocks: 0,
            isa: 0,
            backend: 0,
            parallel_for: None,
            runner_ctx: core::ptr::null_mut(),
            foreign: core::ptr::null(),
            detail: core::ptr::null_mut(),
        }),
        exec_null: false,
        threads: Box::new(1),
        detail_local: Box::new(Detail {
            status: -7,
            argument: [0xee; 32],
            position: 0,
            value: 0,
            message: [0xee; 160],
        }),
        result_local: Box::new([0; 8]),
        misbehaving: false,
    };
    let base = c.arena.base() as usize;
    c.foreign_ctx.arena = (base, base + ARENA);
    if b.one_in(16) {
        c.exec_null = true;
        return c;
    }
    let e = &mut *c.exec;
    e.ub_bytes = match b.u8() % 8 {
        0 => 0,
        1 => 1023,
        2 => 1024 + b.below(4096) as u64,
        3 => b.u64(),
        4 => 1 << 20,
        _ => 1024 << b.below(8),
    };
    e.blocks = match b.u8() % 8 {
        0 => 0,
        1 => b.u32(),
        _ => b.below(70) as u32,
    };
    e.isa = if b.one_in(16) {
        b.u32()
    } else {
        b.below(npukern::Isa::ALL.len() + 1) as u32 // NPK_ISA_AUTO and every npk_isa
    };
    e.backend = match b.u8() % 16 {
        0 => b.u32(),
        1..=3 => 1,
        4..=7 => 2,
        _ => 0,
    };
    match b.u8() % 8 {
        0 | 1 => {
            e.parallel_for = Some(npk_threads_parallel_for);
            if b.bool() {
                *c.threads = b.below(4) as u32;
                e.runner_ctx = (&mut *c.threads as *mut u32).cast();
            }
        }
        2 | 3 => {
            c.runner.mode = b.u8();
            c.misbehaving = !matches!(c.runner.mode % 8, 0 | 1 | 6);
            e.parallel_for = Some(fuzz_runner);
            e.runner_ctx = (&mut *c.runner as *mut RunnerCtx).cast();
        }
        _ => {}
    }
    if e.backend == 2 && !b.one_in(16) {
        let f = &mut *c.foreign;
        f.ctx = (&mut *c.foreign_ctx as *mut ForeignCtx).cast();
        // Mostly the whole table; sometimes one from an older header (0-3
        // entries): the entries past its struct_size must never be called.
        f.struct_size = if b.one_in(4) {
            2 * size_of::<usize>() + (b.u8() % 4) as usize * size_of::<usize>()
        } else {
            size_of::<Foreign>()
        };
        c.foreign_ctx.entries = (f.struct_size - 2 * size_of::<usize>()) / size_of::<usize>();
        let mask = b.u8();
        if mask & 1 != 0 {
            f.rms_norm = Some(f_rms_norm);
        }
        if mask & 2 != 0 {
            f.add_rms_norm = Some(f_add_rms_norm);
        }
        if mask & 4 != 0 {
            f.rms_norm_grad = Some(f_rms_norm_grad);
        }
        if mask & 8 != 0 {
            f.embedding_dense_grad = Some(f_embedding);
        }
        c.foreign_ctx.code = if b.one_in(4) {
            b.pick(&[1, -1, 161002, i32::MAX, i32::MIN])
        } else {
            0
        };
        e.foreign = &*c.foreign;
    }
    match b.u8() % 8 {
        0 => {}
        1 => {
            let off = c.arena.place(b, size_of::<Detail>(), 8, Role::Detail);
            e.detail = c.arena.base().wrapping_add(off).cast();
        }
        _ => e.detail = &mut *c.detail_local,
    }
    c
}

/// The norm template: x's dims and dtype, gamma's rank and dtype.
struct NormShape {
    x: Vec<usize>,
    rows: usize,
    gamma: Vec<usize>,
    dt: u32,
    gdt: u32,
}

fn norm_shape(b: &mut Bytes<'_>) -> NormShape {
    let max_rank = if b.one_in(4) { 8 } else { 3 };
    let rank = 1 + b.below(max_rank);
    let x = dims(b, rank, CAP);
    let g_rank = 1 + b.below(rank);
    let gamma = x[rank - g_rank..].to_vec();
    let rows = x[..rank - g_rank].iter().product();
    let dt = b.below(3) as u32;
    let gdt = if b.bool() { dt } else { 0 };
    NormShape {
        x,
        rows,
        gamma,
        dt,
        gdt,
    }
}

fn norm_opts(b: &mut Bytes<'_>, store: &mut Vec<Box<NormOpts>>) -> *const NormOpts {
    if b.one_in(8) {
        return core::ptr::null();
    }
    let eps = match b.u8() % 8 {
        0 => f64::from(b.f32()),
        1 => f64::from_bits(b.u64()),
        _ => 1e-6,
    };
    let rounding = if b.one_in(16) {
        b.u32()
    } else {
        b.below(2) as u32
    };
    store.push(Box::new(NormOpts {
        eps,
        gamma_offset: b.f32(),
        rounding,
    }));
    &**store.last().unwrap()
}

/// Builds the call's arguments (in the arena) and returns the two closures'
/// results: (size status, size, run status).
fn run_case(data: &[u8]) {
    let mut b = Bytes(data);
    let op = b.u8() % 7;
    if op == 6 {
        // The informational functions, on any status value.
        // SAFETY: they take plain values and return static strings.
        unsafe {
            let s = npk_status_string(b.u32() as i32);
            assert!(!s.is_null() && *s != 0);
            assert!(!npk_version().is_null());
            assert!((1..=npukern::Isa::ALL.len() as u32).contains(&npk_detected_isa()));
        }
        return;
    }
    let arena = Arena::new(&mut b);
    let mut c = build_exec(&mut b, arena);
    let mut nopts = Vec::new();
    let s = &mut c.tensors;
    let a = &mut c.arena;
    // The descriptors; the closure runs the size call or the run call.
    let call: CallFn;
    let (mut gopts, mut eopts, mut lists) = (Vec::new(), Vec::new(), Vec::new());
    match op {
        0 => {
            let ns = norm_shape(&mut b);
            let x = tensor(&mut b, a, s, &ns.x, ns.dt, Role::In);
            let g = tensor(&mut b, a, s, &ns.gamma, ns.gdt, Role::In);
            let y = tensor(&mut b, a, s, &ns.x, ns.dt, Role::Out);
            let r = if b.one_in(3) {
                core::ptr::null()
            } else {
                tensor(&mut b, a, s, &[ns.rows], 0, Role::Out)
            };
            let o = norm_opts(&mut b, &mut nopts);
            call = Box::new(move |c, phase| unsafe {
                match phase {
                    Phase::Size(size) => npk_rms_norm_workspace_size(x, g, o, c.exec_ptr(), size),
                    Phase::Run { ws, wb, .. } => npk_rms_norm(x, g, o, y, r, ws, wb, c.exec_ptr()),
                }
            });
        }
        1 => {
            let ns = norm_shape(&mut b);
            let before = a.ranges.len();
            let x1 = tensor(&mut b, a, s, &ns.x, ns.dt, Role::In);
            // x1's range, if it got one.
            let x1_range = if a.ranges.len() > before {
                before
            } else {
                usize::MAX
            };
            let x2 = tensor(&mut b, a, s, &ns.x, ns.dt, Role::In);
            let g = tensor(&mut b, a, s, &ns.gamma, ns.gdt, Role::In);
            let y = tensor(&mut b, a, s, &ns.x, ns.dt, Role::Out);
            let r = if b.one_in(3) {
                core::ptr::null()
            } else {
                tensor(&mut b, a, s, &[ns.rows], 0, Role::Out)
            };
            let xs = match b.u8() % 4 {
                0 => core::ptr::null(),
                // In place: x_sum is x1.
                1 if !x1.is_null() => {
                    // SAFETY: our descriptor.
                    let t = unsafe { *x1 };
                    mark_in_out(a, x1_range, t.data);
                    s.push(Box::new(t));
                    &**s.last().unwrap()
                }
                _ => {
                    let before = a.ranges.len();
                    let t = tensor(&mut b, a, s, &ns.x, ns.dt, Role::Out);
                    link_in_place(a, x1_range, before);
                    t
                }
            };
            let o = norm_opts(&mut b, &mut nopts);
            call = Box::new(move |c, phase| unsafe {
                match phase {
                    Phase::Size(size) => {
                        npk_add_rms_norm_workspace_size(x1, x2, g, o, c.exec_ptr(), size)
                    }
                    Phase::Run { ws, wb, .. } => {
                        npk_add_rms_norm(x1, x2, g, o, y, r, xs, ws, wb, c.exec_ptr())
                    }
                }
            });
        }
        2 => {
            let ns = norm_shape(&mut b);
            let before = a.ranges.len();
            let dy = tensor(&mut b, a, s, &ns.x, ns.dt, Role::In);
            let dy_range = if a.ranges.len() > before {
                before
            } else {
                usize::MAX
            };
            let x = tensor(&mut b, a, s, &ns.x, ns.dt, Role::In);
            let r = tensor(&mut b, a, s, &[ns.rows], 0, Role::In);
            let g = tensor(&mut b, a, s, &ns.gamma, ns.gdt, Role::In);
            let dres = if b.bool() {
                core::ptr::null()
            } else {
                tensor(&mut b, a, s, &ns.x, ns.dt, Role::In)
            };
            let dx = if b.one_in(3) && !dy.is_null() {
                // SAFETY: our descriptor.
                let t = unsafe { *dy };
                mark_in_out(a, dy_range, t.data);
                s.push(Box::new(t));
                &**s.last().unwrap() as *const Tensor
            } else {
                let before = a.ranges.len();
                let t = tensor(&mut b, a, s, &ns.x, ns.dt, Role::Out);
                link_in_place(a, dy_range, before);
                t
            };
            let dg = if b.one_in(3) {
                core::ptr::null()
            } else {
                tensor(&mut b, a, s, &ns.gamma, 0, Role::Out)
            };
            let dgc = if b.bool() {
                core::ptr::null()
            } else {
                tensor(&mut b, a, s, &ns.gamma, ns.gdt, Role::Out)
            };
            let o: *const GradOpts = if b.one_in(4) {
                core::ptr::null()
            } else {
                gopts.push(Box::new(GradOpts {
                    gamma_offset: b.f32(),
                    accumulate_dgamma: b.u8() % 3,
                }));
                &**gopts.last().unwrap()
            };
            call = Box::new(move |c, phase| unsafe {
                match phase {
                    Phase::Size(size) => {
                        npk_rms_norm_grad_workspace_size(dy, x, r, g, o, c.exec_ptr(), size)
                    }
                    Phase::Run { ws, wb, .. } => {
                        npk_rms_norm_grad(dy, x, r, g, dres, o, dx, dg, dgc, ws, wb, c.exec_ptr())
                    }
                }
            });
        }
        3 => {
            let rank = 1 + b.below(3);
            let id = dims(&mut b, rank, 512);
            let positions: usize = id.iter().product();
            let h = dims(&mut b, 1, 64)[0].min(CAP / positions.max(64));
            let mut gd = id.clone();
            gd.push(h);
            let gdt = b.below(3) as u32;
            let grad = tensor(&mut b, a, s, &gd, gdt, Role::In);
            let idt = 3 + b.below(2) as u32;
            let num_weights: u64 = match b.u8() % 8 {
                0 => b.u64(),
                1 => 0,
                _ => b.below(40) as u64,
            };
            let vocab_start = if b.one_in(4) {
                b.u64() as i64
            } else {
                b.below(3) as i64 * 100
            };
            let idx = tensor(&mut b, a, s, &id, idt, Role::In);
            if !idx.is_null() {
                // Fill the indices with values near the shard.
                // SAFETY: our descriptor.
                let t = unsafe { *idx };
                if t.dtype == idt && !t.data.is_null() {
                    // As many as the (possibly shrunk) descriptor holds.
                    let n = described_bytes(&t).unwrap_or(0) / elem_size(idt).unwrap();
                    for i in 0..n {
                        let v = b.index(num_weights.min(1 << 40) as i64, vocab_start);
                        // SAFETY: inside the placed buffer (n elements of idt;
                        // possibly misaligned, hence unaligned writes).
                        unsafe {
                            if idt == 3 {
                                t.data.cast::<i32>().add(i).write_unaligned(v as i32);
                            } else {
                                t.data.cast::<i64>().add(i).write_unaligned(v);
                            }
                        }
                    }
                }
            }
            let odt = if b.bool() { gdt } else { 0 };
            let nw = num_weights.min(64) as usize;
            let out = tensor(&mut b, a, s, &[nw, h], odt, Role::Out);
            let o: *const EmbOpts = if b.one_in(4) {
                core::ptr::null()
            } else {
                eopts.push(Box::new(EmbOpts {
                    padding_idx: b.index(num_weights.min(1 << 40) as i64, vocab_start),
                    scale_grad_by_freq: b.u8() % 3,
                    vocab_start,
                    out_of_range: if b.one_in(16) {
                        b.u32()
                    } else {
                        b.below(2) as u32
                    },
                    accumulate: b.u8() % 3,
                }));
                &**eopts.last().unwrap()
            };
            call = Box::new(move |c, phase| unsafe {
                match phase {
                    Phase::Size(size) => npk_embedding_dense_grad_workspace_size(
                        grad,
                        idx,
                        num_weights,
                        o,
                        c.exec_ptr(),
                        size,
                    ),
                    Phase::Run { ws, wb, .. } => npk_embedding_dense_grad(
                        grad,
                        idx,
                        num_weights,
                        o,
                        out,
                        ws,
                        wb,
                        c.exec_ptr(),
                    ),
                }
            });
        }
        _ => {
            // grad_stats (4) or clip_grad_norm (5) over a list of descriptors,
            // stored contiguously (the array itself may be NULL).
            let clip = op == 5;
            let n = b.below(6);
            let role = if clip { Role::InOut } else { Role::In };
            let mut list: Vec<Tensor> = Vec::with_capacity(n);
            // Arena ranges before each listed tensor (a shorter count drops
            // the later tensors, which then are no part of the call).
            let mut first_range = Vec::with_capacity(n + 1);
            for _ in 0..n {
                let r = 1 + b.below(3);
                let d = dims(&mut b, r, CAP / 4);
                let dt = b.below(3) as u32;
                let before = a.ranges.len();
                let t = tensor(&mut b, a, s, &d, dt, role);
                if !t.is_null() {
                    first_range.push(before);
                    // SAFETY: our descriptor.
                    list.push(unsafe { *t });
                }
            }
            first_range.push(a.ranges.len());
            let count = if b.one_in(16) {
                b.below(list.len() + 1)
            } else {
                list.len()
            };
            a.ranges.truncate(first_range[count]);
            lists.push(list);
            let list = lists.last().unwrap();
            let arr: *const Tensor = if b.one_in(16) {
                core::ptr::null()
            } else {
                list.as_ptr()
            };
            let max_norm = match b.u8() % 4 {
                0 => f64::from(b.f32()),
                1 => f64::from_bits(b.u64()),
                _ => 1.0,
            };
            let err = b.u8() % 3;
            call = Box::new(move |c, phase| unsafe {
                match phase {
                    Phase::Size(size) => {
                        npk_grad_stats_workspace_size(arr, count, c.exec_ptr(), size)
                    }
                    Phase::Run { ws, wb, res } => {
                        if clip {
                            npk_clip_grad_norm(
                                arr,
                                count,
                                max_norm,
                                err,
                                res.cast(),
                                ws,
                                wb,
                                c.exec_ptr(),
                            )
                        } else {
                            npk_grad_stats(arr, count, res.cast(), ws, wb, c.exec_ptr())
                        }
                    }
                }
            });
        }
    }

    // Phase 1: the size call (its out-pointer anywhere, or NULL).
    let size_ptr = c.result_ptr(&mut b, size_of::<usize>(), Role::Result);
    let (size_status, need) = {
        let snap = c.arena.bytes().to_vec();
        let st = call(&c, Phase::Size(size_ptr.cast()));
        // The size call writes only its size_t (and the detail).
        check_status(&c, st);
        // The answer again, into a local (the detail, written after the
        // size, may lie over the first answer).
        let mut need = 0usize;
        if st == OK {
            assert_eq!(
                call(&c, Phase::Size(&mut need)),
                OK,
                "the size call is not repeatable"
            );
        }
        check_writes(
            &c,
            &snap,
            st,
            |r| {
                matches!(r.role, Role::Result | Role::Detail)
                    && (st == OK || r.role == Role::Detail)
            },
            "size call",
        );
        (st, need)
    };
    c.arena.ranges.retain(|r| r.role != Role::Result);

    // Phase 2: the workspace (size and placement fuzzed) and the run.
    let ws_len = match b.u8() % 8 {
        0 => need.saturating_sub(1 + b.below(64)),
        1 => need.saturating_add(b.below(256)),
        2 => b.below(8192),
        _ => need,
    }
    .min(ARENA / 4);
    let ws: *mut c_void = if ws_len == 0 && b.bool() || b.one_in(32) {
        core::ptr::null_mut()
    } else {
        let off = c.arena.place(&mut b, ws_len, 1, Role::Workspace);
        c.arena.base().wrapping_add(off).cast()
    };
    let res_len = if op == 4 {
        size_of::<Summary>()
    } else {
        size_of::<f64>()
    };
    let res = if op >= 4 {
        c.result_ptr(&mut b, res_len, Role::Result)
    } else {
        core::ptr::null_mut()
    };
    c.foreign_ctx.ws = (ws, ws_len);
    let snap = c.arena.bytes().to_vec();
    let st = call(
        &c,
        Phase::Run {
            ws,
            wb: ws_len,
            res,
        },
    );
    check_status(&c, st);
    // A call the size phase rejected (with a real out-pointer) must fail the
    // same way: the run validates the same arguments first.
    if size_status != OK && !size_ptr.is_null() {
        assert_ne!(
            st, OK,
            "the size call failed ({size_status}) but the run succeeded"
        );
    }
    // The workspace a success used must overlap no tensor.
    if st == OK && !ws.is_null() {
        let w = Range {
            start: ws as usize - c.arena.base() as usize,
            len: need.min(ws_len),
            role: Role::Workspace,
        };
        for r in &c.arena.ranges {
            let tensor = matches!(r.role, Role::In | Role::Out | Role::InOut);
            if tensor
                && r.len > 0
                && w.len > 0
                && r.start < w.start + w.len
                && w.start < r.start + r.len
            {
                panic!("a workspace overlapping a tensor was accepted: {w:?} {r:?} (op {op}; all: {:?}; need {need}, ws_len {ws_len}; tensors {:?})", c.arena.ranges, c.tensors.iter().map(|t| ((t.data as usize).wrapping_sub(c.arena.mem.as_ptr() as usize) as isize, t.dtype, t.ndim, t.shape)).collect::<Vec<_>>());
            }
        }
    }
    if let Some(why) = c.foreign_ctx.bad {
        panic!("foreign backend: {why}");
    }
    if c.foreign_ctx.called && c.foreign_ctx.code != 0 {
        assert_eq!(
            st, ERR_BACKEND,
            "a failing foreign entry must give NPK_ERR_BACKEND"
        );
        if !c.exec.detail.is_null() {
            // SAFETY: a detail we own (local or in the arena).
            let d = unsafe { c.exec.detail.read_unaligned() };
            assert_eq!(d.value, i64::from(c.foreign_ctx.code));
        }
    }
    if c.runner.deviated {
        assert_ne!(
            st,
            OK,
            "a runner that broke its contract (mode {}) got NPK_OK",
            c.runner.mode % 8
        );
    }
    let misbehaving = c.misbehaving;
    let ok = st == OK;
    check_writes(
        &c,
        &snap,
        st,
        |r| match r.role {
            Role::Detail => true,
            Role::Out | Role::InOut | Role::Result => ok || misbehaving,
            Role::Workspace => true,
            Role::In => false,
        },
        "run",
    );
}

/// A closure making one of a case's two calls.
type CallFn = Box<dyn Fn(&Case, Phase) -> i32>;

/// Which of the two calls a closure makes.
#[derive(Clone, Copy)]
enum Phase {
    /// `npk_*_workspace_size` with this out-pointer.
    Size(*mut usize),
    /// The operator: workspace and its length, the result struct pointer.
    Run {
        ws: *mut c_void,
        wb: usize,
        res: *mut c_void,
    },
}

/// When the output placed at range `out` landed exactly on the input at
/// range `inp` (an in-place pair the library accepts), marks the input as
/// written too.
fn link_in_place(a: &mut Arena, inp: usize, out: usize) {
    if let (Some(i), Some(o)) = (a.ranges.get(inp).copied(), a.ranges.get(out).copied()) {
        if inp != out
            && i.role == Role::In
            && o.role == Role::Out
            && i.start == o.start
            && i.len == o.len
        {
            a.ranges[inp].role = Role::InOut;
        }
    }
}

/// Marks range `i` (if it was placed for `data`) as both input and output:
/// the in-place forms.
fn mark_in_out(a: &mut Arena, i: usize, data: *mut c_void) {
    let off = (data as usize).wrapping_sub(a.base() as usize);
    if let Some(r) = a.ranges.get_mut(i) {
        if r.start == off {
            r.role = Role::InOut;
        }
    }
}

fn check_status(c: &Case, st: i32) {
    assert!(STATUSES.contains(&st), "unknown status {st}");
    if !c.exec_null && !c.exec.detail.is_null() {
        // SAFETY: a detail we own (local or in the arena).
        let d = unsafe { c.exec.detail.read_unaligned() };
        assert_eq!(
            d.status, st,
            "the detail's status differs from the return value"
        );
        assert!(
            d.argument.contains(&0) && d.message.contains(&0),
            "detail strings not terminated"
        );
        if st != OK {
            assert!(d.message[0] != 0, "an error without a message");
        }
    }
}

/// Every changed arena byte must lie in a range `allowed` accepts; a
/// success may not change a pure input; a failure (with well-behaved
/// runner and backend) may not change any tensor. Bytes under the detail or
/// a result struct are skipped (those were placed freely, possibly over a
/// tensor, which the library cannot know). Checked per elementary interval
/// between range boundaries (memcmp, not byte loops: this code is
/// instrumented too).
fn check_writes(c: &Case, snap: &[u8], st: i32, allowed: impl Fn(&Range) -> bool, what: &str) {
    let now = c.arena.bytes();
    if now == snap {
        return;
    }
    let mut cuts: Vec<usize> = vec![0, ARENA];
    for r in &c.arena.ranges {
        cuts.push(r.start);
        cuts.push(r.start + r.len);
    }
    cuts.sort_unstable();
    cuts.dedup();
    for w in cuts.windows(2) {
        let (lo, hi) = (w[0], w[1]);
        if now[lo..hi] == snap[lo..hi] {
            continue;
        }
        let o = lo + (lo..hi).position(|i| now[i] != snap[i]).unwrap();
        let hit: Vec<&Range> = c.arena.ranges.iter().filter(|r| r.contains(o)).collect();
        assert!(
            hit.iter().any(|r| allowed(r)),
            "{what} (status {st}) wrote byte {o} outside what it may write: {hit:?}"
        );
        if hit
            .iter()
            .any(|r| matches!(r.role, Role::Detail | Role::Result))
        {
            continue;
        }
        if hit.iter().any(|r| r.role == Role::In) {
            panic!("{what} (status {st}) changed byte {o} of an input: {hit:?}");
        }
        if st != OK
            && !c.misbehaving
            && hit
                .iter()
                .any(|r| matches!(r.role, Role::Out | Role::InOut))
        {
            panic!("{what} failed (status {st}) but changed byte {o} of a tensor: {hit:?}");
        }
    }
}

fuzz_target!(|data: &[u8]| run_case(data));
