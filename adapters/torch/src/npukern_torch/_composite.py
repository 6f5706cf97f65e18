"""Differentiable torch composites of the norm backwards, for double backward.

npukern's backward ops are not differentiable themselves (rms_norm_backward
takes rstd as an input, hiding its dependence on x). When a backward runs
with ``create_graph=True`` (gradient penalties, Hessian-vector products),
the autograd formulas (``csrc/autograd.cpp``) compute dx and dgamma with these
torch ops instead (the ``npukern::_*_composite`` ops ``_autograd.py``
registers), in float32 like the kernel, so that second derivatives are
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


def silu_mul_grads(dy, gate, up):
    """``(dgate, dup)`` of ``y = silu(gate) * up`` as differentiable torch ops
    in float32, rounded to the inputs' dtypes."""
    g, u, d = gate.float(), up.float(), dy.float()
    s = torch.sigmoid(g)
    dgate = d * u * (s * (1 + g * (1 - s)))
    dup = d * (g * s)
    return dgate.to(gate.dtype), dup.to(up.dtype)


def swiglu_grad(dy, x, dim):
    """dx of ``y = silu(a) * b`` with ``a, b = x.chunk(2, dim)``, differentiable."""
    a, b = x.chunk(2, dim)
    da, db = silu_mul_grads(dy, a, b)
    return torch.cat((da, db), dim)


def gelu_mul_grads(dy, gate, up, approximate):
    """``(dgate, dup)`` of ``y = gelu(gate) * up`` (`approximate` 1 the tanh
    form, 0 the erf form) as differentiable torch ops in float32, rounded to
    the inputs' dtypes."""
    g, u, d = gate.float(), up.float(), dy.float()
    form = "tanh" if approximate else "none"
    act = torch.nn.functional.gelu(g, approximate=form)
    dgate = torch.ops.aten.gelu_backward(d * u, g, approximate=form)
    return dgate.to(gate.dtype), (d * act).to(up.dtype)


def geglu_grad(dy, x, dim, approximate, activate_left):
    """dx of torch_npu's ``npu_geglu`` (the gate is x's second half along
    `dim`, the first with `activate_left`), differentiable."""
    a, b = x.chunk(2, dim)
    if activate_left:
        da, db = gelu_mul_grads(dy, a, b, approximate)
        return torch.cat((da, db), dim)
    db, da = gelu_mul_grads(dy, b, a, approximate)
    return torch.cat((da, db), dim)


def rotate_half(x):
    """Hugging Face's rotate_half: ``cat(-x2, x1)`` over the last dim."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def unrotate_half(x):
    """The transpose of :func:`rotate_half`: ``cat(x2, -x1)``."""
    h = x.shape[-1] // 2
    return torch.cat((x[..., h:], -x[..., :h]), dim=-1)


def sum_to(t, like):
    """`t` summed over the dims `like` was broadcast along (in float32), as `like`'s dtype."""
    t = t.float()
    while t.dim() > like.dim():
        t = t.sum(0)
    dims = [i for i, n in enumerate(like.shape) if n == 1 and t.shape[i] != 1]
    return (t.sum(dims, keepdim=True) if dims else t).to(like.dtype)


def rotary_dx(g, cos, sin, backward, like):
    """dx of the rotation ``y = x*cos + rotate_half(x)*sin`` (or, with
    `backward`, of its transpose ``y = x*cos + unrotate_half(x*sin)``) given
    dL/dy = `g`, as differentiable float32 torch ops, in `like`'s dtype."""
    gf, c, s = g.float(), cos.float(), sin.float()
    dx = gf * c + (sum_to(rotate_half(gf) * s, gf) if backward else unrotate_half(gf * s))
    return dx.to(like.dtype)


def rotary_table_grads(g, x, cos, sin, backward):
    """``(dcos, dsin)`` of the same rotation (float32, cos's and sin's shapes)."""
    gf, xf = g.float(), x.float()
    dsin = sum_to(rotate_half(gf) * xf, sin) if backward else sum_to(gf * rotate_half(xf), sin)
    return sum_to(gf * xf, cos), dsin
