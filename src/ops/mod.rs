//! The front end: one folder per operator, each with the same files —
//! `mod.rs` (public API, the `*Call` struct), `plan.rs` (validation and the
//! tiling plan), `cpu.rs` (the kernel, written once over `Lanes`) and
//! `reference.rs` (the f64 golden model) — plus, with the `capi` feature,
//! `capi.rs` (its aclnn-style C entry points), as CANN ops-nn keeps op_host
//! beside op_kernel. Shared norm machinery is in `norm/`. Rust users and the
//! C ABI call the same validation, so both see the same errors.
//!
//! Every operator with an NPU dispatch entry is one line of the registry
//! below: it generates `Op` (what a `Backend` receives), `OpId`, and the CPU
//! and reference dispatch. `docs/adding-an-operator.md` walks through it.

/// The operator registry: `Variant = id => module::CallType, "name"`. The id
/// is the operator's slot in `npk_foreign_backend` (after `struct_size` and
/// `ctx`), so ids are append-only.
macro_rules! operators {
    ($($(#[$doc:meta])* $v:ident = $id:literal => $m:ident :: $call:ident, $name:literal;)*) => {
        /// One validated, planned operator call: what a `Backend` receives.
        /// New operators add variants, so matches need a fallback arm (run
        /// unknown operators on `CPU_SERIAL`, or return an error).
        #[non_exhaustive]
        #[derive(Clone, Copy, Debug)]
        pub enum Op<'a> {
            $($(#[$doc])* $v(&'a $m::$call),)*
        }

        /// An operator's stable number: its slot in `npk_foreign_backend`.
        #[non_exhaustive]
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum OpId {
            $($(#[$doc])* $v = $id,)*
        }

        impl OpId {
            /// Every operator with a dispatch entry, by id.
            pub const ALL: &'static [OpId] = &[$(OpId::$v),*];

            /// The operator's name (its Rust function and `npk_` suffix).
            pub const fn name(self) -> &'static str {
                match self {
                    $(OpId::$v => $name,)*
                }
            }
        }

        impl Op<'_> {
            /// Which operator this is.
            pub const fn id(&self) -> OpId {
                match self {
                    $(Op::$v(_) => OpId::$v,)*
                }
            }

            /// The call struct's address (what a foreign entry receives).
            pub fn as_ptr(&self) -> *const c_void {
                match *self {
                    $(Op::$v(c) => c as *const $m::$call as *const c_void,)*
                }
            }

            /// Runs the call on the CPU kernels of `isa` over `runner`.
            ///
            /// # Safety
            /// The call comes from the front end (see `Backend`), and `isa`
            /// is available on this CPU.
            pub(crate) unsafe fn cpu(self, isa: Available, runner: &dyn Runner) {
                match self {
                    // SAFETY: forwarded from this function's contract.
                    $(Op::$v(c) => unsafe { $m::cpu::cpu(c, isa, runner) },)*
                }
            }

            /// Runs the call on the f64 golden model.
            ///
            /// # Safety
            /// The call comes from the front end (see `Backend`).
            pub(crate) unsafe fn reference(self) {
                match self {
                    // SAFETY: forwarded from this function's contract.
                    $(Op::$v(c) => unsafe { $m::reference::reference(c) },)*
                }
            }
        }

        $(
            impl<'a> From<&'a $m::$call> for Op<'a> {
                fn from(c: &'a $m::$call) -> Op<'a> {
                    Op::$v(c)
                }
            }
        )*
    };
}

// Each operator's folder, declared here rather than by `operators!` so that
// cbindgen (which does not expand macros) finds the C entry points.
pub mod adamw;
pub mod add_rms_norm;
pub mod attention;
pub mod cross_entropy;
pub mod embedding_dense_grad;
pub mod geglu;
pub mod geglu_grad;
pub mod grad_stats;
pub mod matmul;
pub mod rms_norm;
pub mod rms_norm_grad;
pub mod rope;
pub mod swiglu;
pub mod swiglu_grad;

operators! {
    /// RmsNorm (`RmsNormCall`).
    RmsNorm = 0 => rms_norm::RmsNormCall, "rms_norm";
    /// AddRmsNorm (`AddRmsNormCall`).
    AddRmsNorm = 1 => add_rms_norm::AddRmsNormCall, "add_rms_norm";
    /// RmsNormGrad (`RmsNormGradCall`).
    RmsNormGrad = 2 => rms_norm_grad::RmsNormGradCall, "rms_norm_grad";
    /// EmbeddingDenseGrad (`EmbeddingDenseGradCall`).
    EmbeddingDenseGrad = 3 => embedding_dense_grad::EmbeddingDenseGradCall, "embedding_dense_grad";
    /// SwiGLU (`SwigluCall`).
    Swiglu = 4 => swiglu::SwigluCall, "swiglu";
    /// SwiGluGrad (`SwigluGradCall`).
    SwigluGrad = 5 => swiglu_grad::SwigluGradCall, "swiglu_grad";
    /// RoPE, forward and backward (`RopeCall`).
    Rope = 6 => rope::RopeCall, "rope";
    /// CrossEntropy, forward, backward and fused (`CrossEntropyCall`).
    CrossEntropy = 7 => cross_entropy::CrossEntropyCall, "cross_entropy";
    /// GeGLU (`GegluCall`).
    Geglu = 8 => geglu::GegluCall, "geglu";
    /// GeGluGrad (`GegluGradCall`).
    GegluGrad = 9 => geglu_grad::GegluGradCall, "geglu_grad";
    /// AdamW / Adam over tensor lists (`AdamWCall`).
    AdamW = 10 => adamw::AdamWCall, "adamw";
    /// Gradient statistics over a tensor list (`GradStatsCall`).
    GradStats = 11 => grad_stats::GradStatsCall, "grad_stats";
    /// `clip_grad_norm_` over a tensor list (`ClipGradNormCall`).
    ClipGradNorm = 12 => grad_stats::ClipGradNormCall, "clip_grad_norm";
    /// Matmul (`MatmulCall`).
    Matmul = 13 => matmul::MatmulCall, "matmul";
    /// Attention, forward and backward (`AttentionCall`).
    Attention = 14 => attention::AttentionCall, "attention";
}

pub mod elementwise;
pub(crate) mod gated;

/// The tensor lists (`crate::tensor_list`), under their first name.
pub use crate::tensor_list as list;
pub mod norm;

use crate::lanes::detect::Available;
use core::ffi::c_void;

use crate::backend::{Backend, CPU_SERIAL};
use crate::error::{invalid_fmt, Error, Result};
use crate::runner::Runner;
use crate::tiling::{OutputPages, UbConfig};
use crate::workspace::Workspace;

/// Where and how every operator runs: the tiling machine model (`ub`) and
/// the backend (`Cpu` on a runner, `Reference`, or an adapter's).
#[derive(Clone, Copy)]
pub struct Exec<'a> {
    /// Unified Buffer size and block count the plan is cut for.
    pub ub: UbConfig,
    /// Who runs the plan.
    pub backend: &'a dyn Backend,
    /// What the caller knows about its output buffers' pages: how large
    /// outputs are stored (`OutputPages`), never what.
    pub outputs: OutputPages,
}

impl Exec<'static> {
    /// Serial CPU backend, automatic ISA, default tiling.
    pub fn cpu() -> Self {
        Exec {
            ub: UbConfig::default(),
            backend: &CPU_SERIAL,
            outputs: OutputPages::Unknown,
        }
    }
}

impl Exec<'static> {
    /// The f64 reference model (`Reference`), default tiling.
    pub fn reference() -> Self {
        Exec {
            ub: UbConfig::default(),
            backend: &crate::backend::Reference,
            outputs: OutputPages::Unknown,
        }
    }
}

impl Default for Exec<'static> {
    fn default() -> Self {
        Exec::cpu()
    }
}

impl<'a> Exec<'a> {
    /// Default tiling on `backend`.
    pub fn new(backend: &'a dyn Backend) -> Self {
        Exec {
            ub: UbConfig::default(),
            backend,
            outputs: OutputPages::Unknown,
        }
    }

    /// The same, with another tiling machine model.
    pub fn with_ub(self, ub: UbConfig) -> Self {
        Exec { ub, ..self }
    }

    /// The same, with what the caller knows about its output buffers
    /// (`OutputPages::Fresh` when it has just allocated them).
    pub fn with_outputs(self, outputs: OutputPages) -> Self {
        Exec { outputs, ..self }
    }
}

impl core::fmt::Debug for Exec<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Exec")
            .field("ub", &self.ub)
            .field("outputs", &self.outputs)
            .finish_non_exhaustive()
    }
}

/// Calls `$f::<L, X, G>($args)` for the validated (x, gamma) dtype pair.
macro_rules! dispatch_xg {
    ($xd:expr, $gd:expr, $f:ident :: <$L:ty> ($($a:expr),*)) => {{
        use half::{bf16, f16};
        use $crate::dtype::DType;
        match ($xd, $gd) {
            (DType::F16, DType::F16) => $f::<$L, f16, f16>($($a),*),
            (DType::F16, _) => $f::<$L, f16, f32>($($a),*),
            (DType::BF16, DType::BF16) => $f::<$L, bf16, bf16>($($a),*),
            (DType::BF16, _) => $f::<$L, bf16, f32>($($a),*),
            _ => $f::<$L, f32, f32>($($a),*),
        }
    }};
    ($xd:expr, $gd:expr, $f:ident ($($a:expr),*)) => {{
        use half::{bf16, f16};
        use $crate::dtype::DType;
        match ($xd, $gd) {
            (DType::F16, DType::F16) => $f::<f16, f16>($($a),*),
            (DType::F16, _) => $f::<f16, f32>($($a),*),
            (DType::BF16, DType::BF16) => $f::<bf16, bf16>($($a),*),
            (DType::BF16, _) => $f::<bf16, f32>($($a),*),
            _ => $f::<f32, f32>($($a),*),
        }
    }};
}
pub(crate) use dispatch_xg;

pub(crate) use crate::lanes::dispatch_isa;

/// Calls `$f::<$L, .., STREAM>($args)` with `STREAM = $stream` where `$L`
/// streams (`Lanes::STREAMS`), else the `false` form: the condition on
/// `STREAMS` is a constant, so for lanes that do not stream the `true` form
/// is never instantiated.
macro_rules! store_form {
    ($stream:expr, $f:ident::<$L:ty $(, $g:ty)*>($($a:expr),*)) => {
        if !<$L as $crate::lanes::Lanes>::STREAMS {
            $f::<$L $(, $g)*, false>($($a),*)
        } else if $stream {
            $f::<$L $(, $g)*, true>($($a),*)
        } else {
            $f::<$L $(, $g)*, false>($($a),*)
        }
    };
}
pub(crate) use store_form;

/// Runs every block `$b` of a plan (`$flags`, `$blocks`) on `$runner` (the
/// calling thread for a small plan, see `for_plan`), each inside `$L`'s
/// ISA context, as `$f::<$L, .., STREAM>($args)` with `STREAM` the plan's
/// `NORM_FLAG_STREAM` bit where `$L` streams (`Lanes::STREAMS`; elsewhere
/// only the `false` form is instantiated). `plain` first: `$f` has no
/// `STREAM` parameter (a kernel that never streams). `$L` must be available
/// on this CPU (the caller's `dispatch_isa!` chose it). A macro so the block
/// inlines into the context.
macro_rules! run_blocks {
    (plain $runner:expr, $flags:expr, $blocks:expr, |$b:ident| $f:ident::<$L:ty $(, $g:ty)*>($($a:expr),*)) => {{
        let flags: u32 = $flags;
        $crate::runner::for_plan($runner, flags).parallel_for($blocks as usize, &|$b| {
            // SAFETY: the caller's dispatch_isa! picked $L among the ISAs
            // this CPU has.
            unsafe {
                <$L as $crate::lanes::Lanes>::enter(
                    #[inline(always)]
                    || $f::<$L $(, $g)*>($($a),*),
                )
            }
        })
    }};
    ($runner:expr, $flags:expr, $blocks:expr, |$b:ident| $f:ident::<$L:ty $(, $g:ty)*>($($a:expr),*)) => {{
        let flags: u32 = $flags;
        let stream = flags & $crate::tiling::NORM_FLAG_STREAM != 0;
        $crate::runner::for_plan($runner, flags).parallel_for($blocks as usize, &|$b| {
            // SAFETY: the caller's dispatch_isa! picked $L among the ISAs
            // this CPU has.
            unsafe {
                <$L as $crate::lanes::Lanes>::enter(
                    #[inline(always)]
                    || $crate::ops::store_form!(stream, $f::<$L $(, $g)*>($($a),*)),
                )
            }
        })
    }};
}
pub(crate) use run_blocks;

/// A validated `*Call` (from an operator's `prepare`) that the front end
/// hands to a backend once the caller's workspace is attached.
pub(crate) trait OpCall {
    /// Workspace bytes the call's plan needs.
    fn workspace_needed(&self) -> u64;
    /// Lets a call whose workspace only makes it faster run with less: given
    /// `given` bytes, the call may drop that part of its plan (the same
    /// bits either way). Before the workspace is checked.
    fn fit_workspace(&mut self, given: usize);
    /// True when the call has no output element to write (e.g. rows of
    /// length 0 and no rstd): it then returns at once, whatever the row
    /// count, without reaching the backend.
    fn writes_nothing(&self) -> bool;
    /// The first of the call's tensors (inputs and outputs) whose bytes
    /// overlap `[addr, addr + bytes)`, by name.
    fn overlapping(&self, addr: usize, bytes: usize) -> Option<&'static str>;
    /// Records the caller's workspace in the call.
    fn attach(&mut self, ws: *mut c_void, bytes: usize);
    /// The plan's `NORM_FLAG_*` bits, for the store policy to set
    /// `NORM_FLAG_STREAM` (`OutputPages::apply`).
    fn flags_mut(&mut self) -> &mut u32;
    /// Whether the operator writes fresh pages faster streamed (measured:
    /// `docs/performance.md` "Store policy").
    const FRESH_STREAMS: bool = false;
    /// The call as the `Op` a backend receives.
    fn op(&self) -> Op<'_>;
}

/// Implements `OpCall` for a `*Call` struct with `tiling.workspace_bytes`,
/// `workspace` and `workspace_bytes` fields (registered in `operators!`);
/// `$nothing` (a closure on the call) says when it writes nothing; `$t` are
/// its tensor fields (absent optional ones are empty, so never overlap);
/// `fresh_streams = true` keeps large outputs streamed under
/// `OutputPages::Fresh` (an operator measured faster so); `fit` (a closure
/// on the call and the given bytes) drops an optional workspace.
macro_rules! op_call {
    ($call:ty, $nothing:expr, [$($t:ident),*]) => {
        $crate::ops::op_call!($call, $nothing, [$($t),*], fresh_streams = false, fit = |_, _| {});
    };
    ($call:ty, $nothing:expr, [$($t:ident),*], fresh_streams = $fs:literal) => {
        $crate::ops::op_call!($call, $nothing, [$($t),*], fresh_streams = $fs, fit = |_, _| {});
    };
    ($call:ty, $nothing:expr, [$($t:ident),*], fit = $fit:expr) => {
        $crate::ops::op_call!($call, $nothing, [$($t),*], fresh_streams = false, fit = $fit);
    };
    ($call:ty, $nothing:expr, [$($t:ident),*], fresh_streams = $fs:literal, fit = $fit:expr) => {
        impl $crate::ops::OpCall for $call {
            const FRESH_STREAMS: bool = $fs;
            fn workspace_needed(&self) -> u64 {
                self.tiling.workspace_bytes
            }
            fn fit_workspace(&mut self, given: usize) {
                let f: fn(&mut $call, usize) = $fit;
                f(self, given)
            }
            fn writes_nothing(&self) -> bool {
                let f: fn(&$call) -> bool = $nothing;
                f(self)
            }
            fn overlapping(&self, addr: usize, bytes: usize) -> Option<&'static str> {
                $(
                    if self.$t.overlaps(addr, bytes) {
                        return Some(stringify!($t));
                    }
                )*
                None
            }
            fn attach(&mut self, ws: *mut core::ffi::c_void, bytes: usize) {
                self.workspace = ws;
                self.workspace_bytes = bytes;
            }
            fn flags_mut(&mut self) -> &mut u32 {
                &mut self.tiling.flags
            }
            fn op(&self) -> $crate::ops::Op<'_> {
                $crate::ops::Op::from(self)
            }
        }
    };
}
pub(crate) use op_call;

/// Checks and attaches the workspace, then runs the call on `exec`'s backend.
pub(crate) fn launch<C: OpCall>(
    exec: &Exec<'_>,
    mut call: C,
    ws: *mut c_void,
    bytes: usize,
) -> Result<()> {
    call.fit_workspace(bytes);
    Workspace::new(ws, bytes, call.workspace_needed())?;
    // The part of the workspace the call may write must not be a tensor's.
    let used = bytes.min(workspace_len(call.workspace_needed())?);
    if let Some(name) = call.overlapping(ws as usize, used) {
        return Err(invalid_fmt!(
            "workspace",
            "its first {used} bytes overlap {name}"
        ));
    }
    if call.writes_nothing() {
        // Work proportional to the bytes touched: none.
        return Ok(());
    }
    call.attach(ws, bytes);
    // The store policy: how large outputs are written (the plan cut from
    // the shapes says which are large), never what.
    let flags = call.flags_mut();
    *flags = exec.outputs.apply(*flags, C::FRESH_STREAMS);
    // SAFETY: `call` was built by its operator's `prepare` from validated
    // descriptors, and the workspace was just checked against its plan.
    unsafe { exec.backend.launch(call.op()) }
}

/// `launch` with the workspace as a byte slice (the Rust API's form).
pub(crate) fn launch_into<C: OpCall>(exec: &Exec<'_>, call: C, workspace: &mut [u8]) -> Result<()> {
    launch(
        exec,
        call,
        workspace.as_mut_ptr() as *mut c_void,
        workspace.len(),
    )
}

/// A plan's workspace size as a `usize` (what the `*_workspace_size`
/// functions return).
pub(crate) fn workspace_len(bytes: u64) -> Result<usize> {
    usize::try_from(bytes).map_err(|_| Error::SizeOverflow { arg: "workspace" })
}
