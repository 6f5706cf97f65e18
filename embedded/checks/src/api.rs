//! The library calls, each sizing its workspace and running it on a stack
//! buffer (the only scratch there is: no allocator).

use npukern::*;

/// Stack workspace per call; every call here needs at most about half
/// (checked: the fused CrossEntropy on 2x2100 f32 takes 33 KiB).
pub const WS: usize = 64 * 1024;

/// The element types the checks run on (every float dtype).
pub trait El: Float {}
impl<T: Float> El for T {}

fn sized(bytes: Result<usize>) -> Result<usize> {
    match bytes {
        Ok(n) if n > WS => Err(Error::WorkspaceTooSmall {
            needed: n,
            given: WS,
        }),
        r => r,
    }
}

/// RmsNorm: y and rstd.
pub fn rms_norm<T: El, G: El>(
    exec: &Exec<'_>,
    (x, dims): (&[T], &[usize]),
    g: &[G],
    opts: &RmsNormOptions,
    y: &mut [T],
    rstd: &mut [f32],
) -> Result<()> {
    let (xt, gt) = (TensorRef::new(x, dims)?, TensorRef::new(g, &dims[1..])?);
    let n = sized(rms_norm_workspace_size(exec, xt, gt, opts))?;
    let mut ws = [0u8; WS];
    npukern::rms_norm(exec, xt, gt, opts, y, Some(rstd), &mut ws[..n])
}

/// AddRmsNorm, out of place (`x_sum = Some`) or in place over `x1`.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm<T: El, G: El>(
    exec: &Exec<'_>,
    (x1, dims): (&mut [T], &[usize]),
    x2: &[T],
    g: &[G],
    opts: &RmsNormOptions,
    y: &mut [T],
    rstd: &mut [f32],
    x_sum: Option<&mut [T]>,
) -> Result<()> {
    let (x2t, gt) = (TensorRef::new(x2, dims)?, TensorRef::new(g, &dims[1..])?);
    let n = sized(add_rms_norm_workspace_size(
        exec,
        TensorRef::new(x1, dims)?,
        x2t,
        gt,
        opts,
    ))?;
    let mut ws = [0u8; WS];
    match x_sum {
        Some(s) => {
            let x1t = TensorRef::new(x1, dims)?;
            npukern::add_rms_norm(
                exec,
                x1t,
                x2t,
                gt,
                opts,
                y,
                Some(rstd),
                Some(s),
                &mut ws[..n],
            )
        }
        None => {
            let x1m = TensorMut::new(x1, dims)?;
            add_rms_norm_in_place(exec, x1m, x2t, gt, opts, y, Some(rstd), &mut ws[..n])
        }
    }
}

/// The inputs of one RmsNormGrad.
pub struct GradIn<'a, T, G> {
    /// Upstream gradient.
    pub dy: &'a [T],
    /// Forward input.
    pub x: &'a [T],
    /// Its shape.
    pub dims: &'a [usize],
    /// Forward rstd.
    pub rstd: &'a [f32],
    /// Weight.
    pub g: &'a [G],
    /// Residual gradient added to dx.
    pub dres: Option<&'a [T]>,
}

/// RmsNormGrad: dx (into `dx`, or over a copy of dy already in `dx` when
/// `in_place`), dgamma and dgamma_cast.
pub fn rms_norm_grad<T: El, G: El>(
    exec: &Exec<'_>,
    a: &GradIn<'_, T, G>,
    opts: &RmsNormGradOptions,
    dx: &mut [T],
    in_place: bool,
    dgamma: &mut [f32],
    dgamma_cast: &mut [G],
) -> Result<()> {
    let (xt, gt) = (
        TensorRef::new(a.x, a.dims)?,
        TensorRef::new(a.g, &a.dims[1..])?,
    );
    let rt = TensorRef::new(a.rstd, &a.dims[..1])?;
    let dyt = TensorRef::new(a.dy, a.dims)?;
    let dres = match a.dres {
        Some(d) => Some(TensorRef::new(d, a.dims)?),
        None => None,
    };
    let n = sized(rms_norm_grad_workspace_size(
        exec,
        dyt,
        &RmsNormGradInputs {
            x: xt,
            rstd: rt,
            gamma: gt,
            dres,
        },
        opts,
    ))?;
    let mut ws = [0u8; WS];
    let (dg, dc) = (Some(dgamma), Some(dgamma_cast));
    if in_place {
        let dydx = TensorMut::new(dx, a.dims)?;
        rms_norm_grad_in_place(
            exec,
            dydx,
            &RmsNormGradInputs {
                x: xt,
                rstd: rt,
                gamma: gt,
                dres,
            },
            opts,
            DgammaOut {
                dgamma: dg,
                dgamma_cast: dc,
            },
            &mut ws[..n],
        )
    } else {
        npukern::rms_norm_grad(
            exec,
            dyt,
            &RmsNormGradInputs {
                x: xt,
                rstd: rt,
                gamma: gt,
                dres,
            },
            opts,
            dx,
            DgammaOut {
                dgamma: dg,
                dgamma_cast: dc,
            },
            &mut ws[..n],
        )
    }
}

/// EmbeddingDenseGrad of `grad` ([positions, h]) into `out` ([rows, h]).
pub fn embedding<G: El, I: Element, O: El>(
    exec: &Exec<'_>,
    (grad, h): (&[G], usize),
    idx: &[I],
    opts: &EmbeddingGradOptions,
    out: &mut [O],
) -> Result<()> {
    let rows = out.len() / h;
    let gt = TensorRef::new(grad, &[idx.len(), h])?;
    let it = TensorRef::new(idx, &[idx.len()])?;
    let n = sized(embedding_dense_grad_workspace_size(
        exec, gt, it, rows, opts,
    ))?;
    let mut ws = [0u8; WS];
    embedding_dense_grad(exec, gt, it, rows, opts, out, &mut ws[..n])
}

/// The gradient-health executor: the CPU kernels or the f64 reference,
/// the elements cut into 3 blocks.
pub fn grad_exec(reference: bool) -> Exec<'static> {
    let e = if reference {
        Exec::reference()
    } else {
        Exec::cpu()
    };
    e.with_ub(UbConfig {
        blocks: 3,
        ..UbConfig::default()
    })
}

/// grad_stats over `list`.
pub fn grad_stats(reference: bool, list: &[GradTensor<'_>]) -> Result<GradSummary> {
    let exec = grad_exec(reference);
    let n = sized(grad_stats_workspace_size(&exec, list))?;
    let mut ws = [0u8; WS];
    npukern::grad_stats(&exec, list, &mut ws[..n])
}

/// clip_grad_norm over `list`; the total norm.
pub fn clip(
    list: &mut [GradTensorMut<'_>],
    max_norm: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    let exec = grad_exec(false);
    let opts = ClipGradNormOptions {
        max_norm,
        error_if_nonfinite,
    };
    let n = sized(clip_grad_norm_workspace_size(&exec, list, &opts))?;
    let mut ws = [0u8; WS];
    clip_grad_norm(&exec, list, &opts, &mut ws[..n])
}

/// One AdamW step over the lists, on `grad_exec(reference)`.
pub fn adamw(
    reference: bool,
    tensors: &mut AdamWTensors<'_, '_>,
    opts: &AdamWOptions,
) -> Result<AdamWReport> {
    let exec = grad_exec(reference);
    let n = sized(adamw_workspace_size(&exec, tensors, opts))?;
    let mut ws = [0u8; WS];
    npukern::adamw(&exec, tensors, opts, &mut ws[..n])
}

/// One AdamW step with the state in `formats` (8-bit moments' block scales
/// in `scales`), on `grad_exec(reference)`.
pub fn adamw_with_scales(
    reference: bool,
    tensors: &mut AdamWTensors<'_, '_>,
    scales: &mut AdamWScales<'_, '_>,
    opts: &AdamWOptions,
    formats: &AdamWFormats<'_>,
) -> Result<AdamWReport> {
    let exec = grad_exec(reference);
    let n = sized(adamw_with_scales_workspace_size(
        &exec, tensors, scales, opts, formats,
    ))?;
    let mut ws = [0u8; WS];
    npukern::adamw_with_scales(&exec, tensors, scales, opts, formats, &mut ws[..n])
}

/// The inputs of one CrossEntropy: logits `[rows, cols]`, targets and
/// optional class weights.
pub struct CeIn<'a, T, I> {
    /// Logits.
    pub x: &'a [T],
    /// Their shape.
    pub dims: [usize; 2],
    /// Class indices, one per row.
    pub tgt: &'a [I],
    /// Class weights, one per class.
    pub w: Option<&'a [f32]>,
}

impl<T: El, I: Element> CeIn<'_, T, I> {
    fn targets(&self) -> Result<CrossEntropyTargets<'_, I>> {
        let t = CrossEntropyTargets::new(TensorRef::new(self.tgt, &self.dims[..1])?);
        Ok(match self.w {
            Some(w) => t.with_weight(TensorRef::new(w, &self.dims[1..])?),
            None => t,
        })
    }

    fn logits(&self) -> Result<TensorRef<'_, T>> {
        TensorRef::new(self.x, &self.dims)
    }
}

/// CrossEntropy forward: `loss` (rows f32, or one when reducing) and `lse`.
pub fn cross_entropy<T: El, I: Element>(
    exec: &Exec<'_>,
    a: &CeIn<'_, T, I>,
    opts: &CrossEntropyOptions,
    loss: &mut [f32],
    lse: &mut [f32],
) -> Result<()> {
    let (xt, tt) = (a.logits()?, a.targets()?);
    let n = sized(cross_entropy_workspace_size(exec, xt, tt, opts))?;
    let mut ws = [0u8; WS];
    npukern::cross_entropy(exec, xt, tt, opts, loss, Some(lse), &mut ws[..n])
}

/// CrossEntropy backward: dlogits into `dx`, or over a copy of the logits
/// already in `dx` when `in_place`.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_grad<T: El, I: Element>(
    exec: &Exec<'_>,
    a: &CeIn<'_, T, I>,
    lse: &[f32],
    grad: &[f32],
    opts: &CrossEntropyOptions,
    dx: &mut [T],
    in_place: bool,
) -> Result<()> {
    let (xt, tt) = (a.logits()?, a.targets()?);
    let n = sized(cross_entropy_grad_workspace_size(exec, xt, tt, opts))?;
    let mut ws = [0u8; WS];
    if in_place {
        let xm = TensorMut::new(dx, &a.dims)?;
        cross_entropy_grad_in_place(exec, xm, tt, lse, grad, opts, &mut ws[..n])
    } else {
        npukern::cross_entropy_grad(exec, xt, tt, lse, grad, opts, dx, &mut ws[..n])
    }
}

/// The fused CrossEntropy over a copy of the logits already in `dx`: the
/// per-row loss, lse, and dlogits in place scaled by `grad_scale`.
pub fn cross_entropy_fused<T: El, I: Element>(
    exec: &Exec<'_>,
    a: &CeIn<'_, T, I>,
    grad_scale: &[f32],
    opts: &CrossEntropyOptions,
    (loss, lse): (&mut [f32], &mut [f32]),
    dx: &mut [T],
) -> Result<()> {
    let (xt, tt) = (a.logits()?, a.targets()?);
    let n = sized(cross_entropy_fused_workspace_size(exec, xt, tt, opts))?;
    let mut ws = [0u8; WS];
    let xm = TensorMut::new(dx, &a.dims)?;
    npukern::cross_entropy_fused(
        exec,
        xm,
        tt,
        grad_scale,
        opts,
        loss,
        Some(lse),
        &mut ws[..n],
    )
}
