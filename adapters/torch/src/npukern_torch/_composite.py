"""Differentiable torch composites of the norm backwards, for double backward.

npukern's backward ops are not differentiable themselves (rms_norm_backward
takes rstd as an input, hiding its dependence on x). When a backward runs
with ``create_graph=True`` (gradient penalties, Hessian-vector products),
the autograd formulas in ``_autograd.py`` compute dx and dgamma with these
torch ops instead, in float32 like the kernel, so that second derivatives are
exact -- never a silent zero. Their first-derivative bits are then torch's
float32 composite's, not the kernel's (documented in the adapter's docs)."""

import torch


def _norm_dims(x, gamma):
    return tuple(range(x.dim() - gamma.dim(), x.dim()))


def rms_norm_grads(dy, x, gamma, eps, offset=0.0, dx_extra=None):
    """``(dx, dgamma)`` of ``y = x * rsqrt(mean(x^2) + eps) * (offset + gamma)`` over the
    trailing dims gamma covers, as differentiable torch ops in float32;
    `dx_extra` (AddRmsNorm's residual gradient) is added before rounding."""
    dims = _norm_dims(x, gamma)
    xf, g, dyf = x.float(), gamma.float() + offset, dy.float()
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)
    xh = xf * rstd
    dxh = dyf * g
    dx = rstd * (dxh - xh * (dxh * xh).mean(dims, keepdim=True))
    if dx_extra is not None:
        dx = dx + dx_extra.float()
    lead = tuple(range(x.dim() - gamma.dim()))
    dgamma = (dyf * xh).sum(lead) if lead else dyf * xh
    return dx.to(x.dtype), dgamma.to(gamma.dtype)


def embedding_grad_of_grad(ggw, indices, vocab_start, padding_idx, scale_grad_by_freq, grad_dtype):
    """The derivative of EmbeddingDenseGrad with respect to its `grad` input,
    applied to `ggw` (a gradient of the table): EmbeddingDenseGrad is linear
    in grad, so this is the lookup of ggw's rows at the indices -- zero at
    the padding id and at ids outside the table (shard) -- divided by each
    id's count when `scale_grad_by_freq`."""
    flat = indices.reshape(-1).long()
    local = flat - vocab_start
    rows = ggw.shape[0]
    keep = (local >= 0) & (local < rows) & (flat != padding_idx)
    picked = ggw.index_select(0, torch.where(keep, local, torch.zeros_like(local)))
    picked = torch.where(keep.unsqueeze(-1), picked, torch.zeros_like(picked))
    if scale_grad_by_freq:
        _, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
        picked = picked / counts[inverse].unsqueeze(-1).to(picked.dtype)
    return picked.reshape(*indices.shape, ggw.shape[-1]).to(grad_dtype)
