"""Autograd formulas of the forward ops, registered with torch.library so that
autograd (and AOTAutograd under torch.compile) works on the ops themselves:
each forward saves what its backward op needs (x or x_sum, gamma, rstd;
the indices), and the backward calls npukern's backward op. rstd is an
auxiliary output and not differentiable (as in torch_npu).

Double backward: with ``create_graph=True`` the norms' backward runs a
differentiable float32 torch composite (``_composite.py``); the embedding's
backward op is linear in its gradient and has its own derivative (a lookup).
The norm backward ops called directly have no derivative and say so."""

import torch

from . import _composite

ops = torch.ops.npukern


def _building_graph(*tensors):
    """True inside a ``create_graph=True`` backward that must record how the
    gradients depend on their inputs."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _cast_dgamma(dgamma, gamma):
    # The kernel's dgamma is f32 (the main-grad dtype); autograd needs gamma's.
    return dgamma if dgamma.dtype == gamma.dtype else dgamma.to(gamma.dtype)


def _rms_norm_setup(ctx, inputs, output):
    x, gamma, eps, offset, _cast_before_gamma = inputs
    _y, rstd = output
    ctx.save_for_backward(x, gamma, rstd)
    ctx.mark_non_differentiable(rstd)
    ctx.eps, ctx.offset = eps, offset


def _rms_norm_backward(ctx, dy, _drstd):
    x, gamma, rstd = ctx.saved_tensors
    if _building_graph(dy, x, gamma):
        dx, dgamma = _composite.rms_norm_grads(dy, x, gamma, ctx.eps, ctx.offset)
        return dx, dgamma, None, None, None
    dx, dgamma = ops.rms_norm_backward(dy, x, gamma, rstd, ctx.offset)
    return dx, _cast_dgamma(dgamma, gamma), None, None, None


def _add_rms_norm_setup(ctx, inputs, output):
    _x1, _x2, gamma, eps, offset, _cast_before_gamma = inputs
    _y, rstd, x_sum = output
    ctx.save_for_backward(x_sum, gamma, rstd)
    ctx.mark_non_differentiable(rstd)
    ctx.eps, ctx.offset = eps, offset


def _add_rms_norm_backward(ctx, dy, _drstd, dx_sum):
    x_sum, gamma, rstd = ctx.saved_tensors
    if _building_graph(dy, x_sum, gamma, dx_sum):
        dx, dgamma = _composite.rms_norm_grads(dy, x_sum, gamma, ctx.eps, ctx.offset, dx_sum)
        return dx, dx, dgamma, None, None, None
    dx, dgamma = ops.add_rms_norm_backward(dy, x_sum, gamma, rstd, dx_sum, ctx.offset)
    # x_sum = x1 + x2: both addends get the same gradient.
    return dx, dx, _cast_dgamma(dgamma, gamma), None, None, None


def _embedding_setup(ctx, inputs, output):
    weight, indices, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    ctx.num_weights = weight.shape[0]
    ctx.padding_idx = padding_idx
    ctx.scale_grad_by_freq = scale_grad_by_freq


def _embedding_backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    dw = ops.embedding_dense_backward(grad, indices, ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq)
    return dw, None, None, None


def _embedding_shard_setup(ctx, inputs, output):
    weight, indices, _num_embeddings, vocab_start, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    ctx.rows = weight.shape[0]
    ctx.vocab_start = vocab_start
    ctx.padding_idx = padding_idx
    ctx.scale_grad_by_freq = scale_grad_by_freq


def _embedding_shard_backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    dw = ops.embedding_dense_backward_shard(
        grad, indices, ctx.rows, ctx.vocab_start, ctx.padding_idx, ctx.scale_grad_by_freq
    )
    return dw, None, None, None, None, None


def _dense_grad_setup(ctx, inputs, output):
    grad, indices, _num_weights, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    ctx.args = (0, padding_idx, scale_grad_by_freq, grad.dtype)
    ctx.n_inputs = len(inputs)


def _dense_grad_shard_setup(ctx, inputs, output):
    grad, indices, _num_weights, vocab_start, padding_idx, scale_grad_by_freq = inputs
    ctx.save_for_backward(indices)
    ctx.args = (vocab_start, padding_idx, scale_grad_by_freq, grad.dtype)
    ctx.n_inputs = len(inputs)


def _dense_grad_backward(ctx, ggw):
    (indices,) = ctx.saved_tensors
    gg = _composite.embedding_grad_of_grad(ggw, indices, *ctx.args)
    return (gg,) + (None,) * (ctx.n_inputs - 1)


def _no_derivative(op):
    def backward(ctx, *grads):
        if "norm" not in op:
            raise RuntimeError(f"npukern::{op} has no derivative of its own (no double backward for it)")
        raise RuntimeError(
            f"npukern::{op} has no derivative of its own (its rstd input hides how it depends on x); to "
            "differentiate a norm twice, call backward with create_graph=True through npukern.rms_norm / "
            "add_rms_norm (or the modules), which then run a differentiable composite"
        )

    return backward


def _keep(ctx, inputs, output):
    pass


def _swiglu_setup(ctx, inputs, output):
    x, dim, eager = inputs
    ctx.save_for_backward(x)
    ctx.dim, ctx.eager = dim, eager


def _swiglu_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return ops.swiglu_backward(grad, x, ctx.dim, ctx.eager), None, None


def _silu_mul_setup(ctx, inputs, output):
    gate, up, eager = inputs
    ctx.save_for_backward(gate, up)
    ctx.eager = eager


def _silu_mul_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    dgate, dup = ops.silu_mul_backward(grad, gate, up, ctx.eager)
    return dgate, dup, None


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _unrotate_half(x):
    # The transpose of rotate_half: cat(x2, -x1).
    h = x.shape[-1] // 2
    return torch.cat((x[..., h:], -x[..., :h]), dim=-1)


def _sum_to(t, like):
    """`t` summed over the dims `like` was broadcast along (in float32), as `like`'s dtype."""
    t = t.float()
    while t.dim() > like.dim():
        t = t.sum(0)
    dims = [i for i, n in enumerate(like.shape) if n == 1 and t.shape[i] != 1]
    return (t.sum(dims, keepdim=True) if dims else t).to(like.dtype)


def _table_grads(ctx, pairs, cos, sin):
    """cos/sin gradients (rarely wanted: Hugging Face computes them without
    grad) from a float32 composite: y = x*cos + rotate_half(x)*sin."""
    if not (ctx.needs_input_grad[ctx.cos_at] or ctx.needs_input_grad[ctx.cos_at + 1]):
        return None, None
    if ctx.backward:
        raise NotImplementedError("npukern: cos/sin gradients of the backward rotation are not implemented")
    dcos = sum(_sum_to(g.float() * x.float(), cos) for g, x in pairs)
    dsin = sum(_sum_to(g.float() * _rotate_half(x.float()), sin) for g, x in pairs)
    return dcos.to(cos.dtype), dsin.to(sin.dtype)


def _rotary_mul_setup(ctx, inputs, output):
    x, cos, sin, eager, backward = inputs
    ctx.save_for_backward(x, cos, sin)
    ctx.eager, ctx.backward, ctx.cos_at = eager, backward, 1


def _rotary_mul_backward(ctx, grad):
    x, cos, sin = ctx.saved_tensors
    dx = ops.rotary_mul(grad, cos, sin, ctx.eager, not ctx.backward)
    dcos, dsin = _table_grads(ctx, [(grad, x)], cos, sin)
    return dx, dcos, dsin, None, None


def _rope_qk_setup(ctx, inputs, output):
    q, k, cos, sin, eager, backward = inputs
    ctx.save_for_backward(q, k, cos, sin)
    ctx.eager, ctx.backward, ctx.cos_at = eager, backward, 2


def _rope_qk_backward(ctx, gq, gk):
    q, k, cos, sin = ctx.saved_tensors
    gq = torch.zeros_like(q) if gq is None else gq
    gk = torch.zeros_like(k) if gk is None else gk
    dq, dk = ops.rope_qk(gq, gk, cos, sin, ctx.eager, not ctx.backward)
    dcos, dsin = _table_grads(ctx, [(gq, q), (gk, k)], cos, sin)
    return dq, dk, dcos, dsin, None, None


torch.library.register_autograd("npukern::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
torch.library.register_autograd("npukern::add_rms_norm", _add_rms_norm_backward, setup_context=_add_rms_norm_setup)
torch.library.register_autograd("npukern::embedding", _embedding_backward, setup_context=_embedding_setup)
torch.library.register_autograd(
    "npukern::embedding_shard", _embedding_shard_backward, setup_context=_embedding_shard_setup
)
torch.library.register_autograd(
    "npukern::embedding_dense_backward", _dense_grad_backward, setup_context=_dense_grad_setup
)
torch.library.register_autograd(
    "npukern::embedding_dense_backward_shard", _dense_grad_backward, setup_context=_dense_grad_shard_setup
)
torch.library.register_autograd("npukern::rms_norm_backward", _no_derivative("rms_norm_backward"), setup_context=_keep)
torch.library.register_autograd(
    "npukern::add_rms_norm_backward", _no_derivative("add_rms_norm_backward"), setup_context=_keep
)
torch.library.register_autograd("npukern::swiglu", _swiglu_backward, setup_context=_swiglu_setup)
torch.library.register_autograd("npukern::silu_mul", _silu_mul_backward, setup_context=_silu_mul_setup)
torch.library.register_autograd("npukern::rotary_mul", _rotary_mul_backward, setup_context=_rotary_mul_setup)
torch.library.register_autograd("npukern::rope_qk", _rope_qk_backward, setup_context=_rope_qk_setup)
torch.library.register_autograd("npukern::swiglu_backward", _no_derivative("swiglu_backward"), setup_context=_keep)
torch.library.register_autograd(
    "npukern::silu_mul_backward", _no_derivative("silu_mul_backward"), setup_context=_keep
)
