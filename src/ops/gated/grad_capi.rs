//! The C skin of the gated backward operators, written once over `GradOp`:
//! `npk_swiglu_grad*` and `npk_geglu_grad*` read the same descriptors (dy,
//! the gate or the split x, up or NULL; dx or dgate, dup or NULL) and differ
//! in their options struct (`GradCapi`).

use core::marker::PhantomData;

use super::grad_api::GradOp;
use crate::capi::skin::{CapiCall, CapiOp};
use crate::capi::types::{read_opt_tensor, read_tensor};
use crate::error::Result;
use crate::tensor::RawTensor;
use crate::tiling::UbConfig;

/// A gated backward operator's C options.
pub(crate) trait GradCapi: GradOp {
    /// `npk_swiglu_options` / `npk_geglu_options`.
    type COpts;
    /// Reads them (NULL: the defaults).
    ///
    /// # Safety
    /// `p` is NULL or valid.
    unsafe fn read_options(p: *const Self::COpts) -> Result<Self::Opts>;
}

/// The skin of one gated backward operator.
pub(crate) struct GradSkin<G>(PhantomData<G>);

impl<G: GradCapi> CapiOp for GradSkin<G> {
    type Args = (
        *const RawTensor,
        *const RawTensor,
        *const RawTensor,
        *const G::COpts,
    );
    type Inputs = (RawTensor, RawTensor, Option<RawTensor>, G::Opts);

    unsafe fn read((dy, a, b, opts): Self::Args) -> Result<Self::Inputs> {
        // SAFETY: every pointer is NULL or valid (the exported function's contract).
        unsafe {
            Ok((
                read_tensor(dy, "dy")?,
                read_tensor(a, if b.is_null() { "x" } else { "gate" })?,
                read_opt_tensor(b, "up")?,
                G::read_options(opts)?,
            ))
        }
    }

    fn plan((dy, a, b, opts): &Self::Inputs, ub: &UbConfig) -> Result<u64> {
        Ok(G::plan(dy, a, b.as_ref(), opts, ub)?.workspace_bytes)
    }
}

impl<G: GradCapi> CapiCall for GradSkin<G> {
    type Outputs = (*const RawTensor, *const RawTensor);
    type Call = G::Call;

    unsafe fn prepare(
        (dy, a, b, opts): Self::Inputs,
        (da, db): Self::Outputs,
        ub: &UbConfig,
    ) -> Result<G::Call> {
        // `b` was read as None exactly when it is NULL (the split form).
        let split = b.is_none();
        // SAFETY: every pointer is NULL or valid (the exported function's contract).
        let (da, db) = unsafe {
            (
                read_tensor(da, if split { "dx" } else { "dgate" })?,
                read_opt_tensor(db, if split { "db" } else { "dup" })?,
            )
        };
        G::prepare(&dy, &a, b.as_ref(), &opts, &da, db.as_ref(), ub)
    }
}
