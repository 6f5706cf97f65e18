//! The gated backward operators' front end, written once: SwiGluGrad and
//! GeGluGrad differ only in their options and call struct (`GradOp`), so
//! the split form (`dx` from `x`), the two-tensor form (`dgate`, `dup`) and
//! the C skin are these generic functions over it.

use crate::dtype::Float;
use crate::error::Result;
use crate::ops::{launch_into, workspace_len, Exec, OpCall};
use crate::tensor::{out_like, RawTensor, TensorRef};
use crate::tiling::{EltTiling, UbConfig};

/// One gated backward operator: its options and its plan / prepare.
pub(crate) trait GradOp {
    /// `SwigluOptions` / `GegluOptions`.
    type Opts;
    /// The validated call.
    type Call: OpCall;
    /// The plan of `dy`, the gate `a` and (two-tensor form) `b`.
    fn plan(
        dy: &RawTensor,
        a: &RawTensor,
        b: Option<&RawTensor>,
        o: &Self::Opts,
        ub: &UbConfig,
    ) -> Result<EltTiling>;
    /// Validates everything and builds the call.
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        dy: &RawTensor,
        a: &RawTensor,
        b: Option<&RawTensor>,
        o: &Self::Opts,
        da: &RawTensor,
        db: Option<&RawTensor>,
        ub: &UbConfig,
    ) -> Result<Self::Call>;
}

/// Workspace bytes of the split form (always 0).
pub(crate) fn split_size<G: GradOp, T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    x: TensorRef<'_, T>,
    o: &G::Opts,
) -> Result<usize> {
    workspace_len(G::plan(&dy.raw(), &x.raw(), None, o, &exec.ub)?.workspace_bytes)
}

/// The split form: `dx` (x's shape) from `dy` and `x`.
pub(crate) fn split<G: GradOp, T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    x: TensorRef<'_, T>,
    o: &G::Opts,
    dx: &mut [T],
    workspace: &mut [u8],
) -> Result<()> {
    let dxr = out_like(dx, x.shape(), "dx", "x")?;
    let call = G::prepare(&dy.raw(), &x.raw(), None, o, &dxr, None, &exec.ub)?;
    launch_into(exec, call, workspace)
}

/// Workspace bytes of the two-tensor form (always 0).
pub(crate) fn pair_size<G: GradOp, T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    gate: TensorRef<'_, T>,
    up: TensorRef<'_, T>,
    o: &G::Opts,
) -> Result<usize> {
    workspace_len(G::plan(&dy.raw(), &gate.raw(), Some(&up.raw()), o, &exec.ub)?.workspace_bytes)
}

/// The two-tensor form: `dgate` and `dup` (gate's shape).
#[allow(clippy::too_many_arguments)]
pub(crate) fn pair<G: GradOp, T: Float>(
    exec: &Exec<'_>,
    dy: TensorRef<'_, T>,
    gate: TensorRef<'_, T>,
    up: TensorRef<'_, T>,
    o: &G::Opts,
    dgate: &mut [T],
    dup: &mut [T],
    workspace: &mut [u8],
) -> Result<()> {
    let dar = out_like(dgate, gate.shape(), "dgate", "gate")?;
    let dbr = out_like(dup, gate.shape(), "dup", "gate")?;
    let call = G::prepare(
        &dy.raw(),
        &gate.raw(),
        Some(&up.raw()),
        o,
        &dar,
        Some(&dbr),
        &exec.ub,
    )?;
    launch_into(exec, call, workspace)
}

/// `GradOp` for an operator's `Op` from its options and call types and its
/// `plan` / `prepare` (the same signatures in both operators' plan.rs).
macro_rules! grad_op {
    ($opts:ty, $call:ty) => {
        /// The operator as the gated family's backward (`ops::gated::grad_api`).
        pub(crate) struct Op;

        impl $crate::ops::gated::grad_api::GradOp for Op {
            type Opts = $opts;
            type Call = $call;
            fn plan(
                dy: &RawTensor,
                a: &RawTensor,
                b: Option<&RawTensor>,
                o: &$opts,
                ub: &UbConfig,
            ) -> Result<EltTiling> {
                plan(dy, a, b, o, ub)
            }
            fn prepare(
                dy: &RawTensor,
                a: &RawTensor,
                b: Option<&RawTensor>,
                o: &$opts,
                da: &RawTensor,
                db: Option<&RawTensor>,
                ub: &UbConfig,
            ) -> Result<$call> {
                prepare(dy, a, b, o, da, db, ub)
            }
        }
    };
}
pub(crate) use grad_op;
