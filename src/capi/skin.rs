//! The shape every operator's C skin shares. `npk_<op>_workspace_size`
//! reads the inputs and options and plans; `npk_<op>` reads them the same
//! way, then its outputs, prepares the call and launches it on the caller's
//! workspace. An operator states only what is its own — how its arguments
//! are read and which `plan` / `prepare` they go to (`CapiOp`, `CapiCall`)
//! — and `workspace_size` / `launch` do the rest through `exec::run_size`
//! and `exec::run` (the `npk_exec`, the `size_t*`, the status and its
//! detail), in the same order for every operator.

use core::ffi::c_void;

use super::exec::{run, run_size};
use super::types::{npk_exec, npk_status};
use crate::error::Result;
use crate::ops::OpCall;
use crate::tiling::UbConfig;

/// What an operator's size call reads and plans: the C arguments it shares
/// with the run (the inputs and options), read into Rust values.
pub(crate) trait CapiOp {
    /// Those C arguments as the caller passed them (pointers, counts).
    type Args;
    /// What reading them gives.
    type Inputs;

    /// Reads `args`, in the order their errors are reported.
    ///
    /// # Safety
    /// Every pointer in `args` is NULL or valid for its type (the exported
    /// function's contract).
    unsafe fn read(args: Self::Args) -> Result<Self::Inputs>;

    /// The workspace bytes the plan of `inputs` needs.
    fn plan(inputs: &Self::Inputs, ub: &UbConfig) -> Result<u64>;
}

/// What an operator's run reads beyond the inputs, and the call it builds.
pub(crate) trait CapiCall: CapiOp {
    /// The run's own C arguments (its outputs) as the caller passed them.
    type Outputs;
    /// The validated call `prepare` builds.
    type Call: OpCall;

    /// Reads `outputs` and prepares the call.
    ///
    /// # Safety
    /// Every pointer in `outputs` is NULL or valid for its type.
    unsafe fn prepare(
        inputs: Self::Inputs,
        outputs: Self::Outputs,
        ub: &UbConfig,
    ) -> Result<Self::Call>;
}

/// The body of `npk_<op>_workspace_size`: reads `args`, plans, writes the
/// plan's workspace bytes to `*workspace_bytes`.
///
/// # Safety
/// As for `exec::run_size`, and every pointer in `args` is NULL or valid.
pub(crate) unsafe fn workspace_size<Op: CapiOp>(
    args: Op::Args,
    exec: *const npk_exec,
    workspace_bytes: *mut usize,
) -> npk_status {
    // SAFETY: forwarded from the caller.
    unsafe { run_size(exec, workspace_bytes, |e| Op::plan(&Op::read(args)?, &e.ub)) }
}

/// The body of `npk_<op>`: reads `args` and `outputs`, prepares the call and
/// launches it on `workspace` (checked against the plan first).
///
/// # Safety
/// As for `exec::run`, and every pointer in `args` and `outputs` is NULL or
/// valid; every tensor's data is live for the call.
pub(crate) unsafe fn launch<Op: CapiCall>(
    args: Op::Args,
    outputs: Op::Outputs,
    workspace: *mut c_void,
    workspace_bytes: usize,
    exec: *const npk_exec,
) -> npk_status {
    // SAFETY: forwarded from the caller.
    unsafe {
        run(exec, |e| {
            let call = Op::prepare(Op::read(args)?, outputs, &e.ub)?;
            crate::ops::launch(e, call, workspace, workspace_bytes)
        })
    }
}
