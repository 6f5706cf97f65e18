"""Autograd formulas of the forward ops, registered with torch.library so that
autograd (and AOTAutograd under torch.compile) works on the ops themselves:
each forward saves what its backward op needs (x or x_sum, gamma, rstd;
the indices), and the backward calls npukern's backward op. rstd is an
auxiliary output and not differentiable (as in torch_npu).

Double backward: with ``create_graph=True`` the backward of the norms,
SwiGLU (``swiglu``, ``silu_mul``) and RoPE (``rotary_mul``, ``rope_qk``,
with or without cos/sin gradients) runs a differentiable float32 torch
composite (``_composite.py``); the embedding's backward op is linear in its
gradient and has its own derivative (a lookup). The backward ops called
directly have no derivative and say so."""

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
    if _building_graph(grad, x):
        return _composite.swiglu_grad(grad, x, ctx.dim), None, None
    return ops.swiglu_backward(grad, x, ctx.dim, ctx.eager), None, None


def _silu_mul_setup(ctx, inputs, output):
    gate, up, eager = inputs
    ctx.save_for_backward(gate, up)
    ctx.eager = eager


def _silu_mul_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    if _building_graph(grad, gate, up):
        dgate, dup = _composite.silu_mul_grads(grad, gate, up)
    else:
        dgate, dup = ops.silu_mul_backward(grad, gate, up, ctx.eager)
    return dgate, dup, None


def _wants_tables(ctx):
    return ctx.needs_input_grad[ctx.cos_at] or ctx.needs_input_grad[ctx.cos_at + 1]


def _rotation_grads(ctx, pairs, cos, sin):
    """dx per (grad, x) pair and the cos/sin gradients. The kernel rotates
    the gradients; the tables' gradients (rarely wanted: Hugging Face
    computes cos/sin without grad) and everything under ``create_graph=True``
    (double backward) come from the differentiable float32 composite."""
    if _building_graph(cos, sin, *(t for pair in pairs for t in pair)):
        dxs = [_composite.rotary_dx(g, cos, sin, ctx.backward, x) for g, x in pairs]
    elif len(pairs) == 1:
        dxs = [ops.rotary_mul(pairs[0][0], cos, sin, ctx.eager, not ctx.backward)]
    else:
        dxs = list(ops.rope_qk(pairs[0][0], pairs[1][0], cos, sin, ctx.eager, not ctx.backward))
    if not _wants_tables(ctx):
        return dxs, None, None
    parts = [_composite.rotary_table_grads(g, x, cos, sin, ctx.backward) for g, x in pairs]
    return dxs, sum(p[0] for p in parts).to(cos.dtype), sum(p[1] for p in parts).to(sin.dtype)


def _rotary_mul_setup(ctx, inputs, output):
    x, cos, sin, eager, backward = inputs
    ctx.save_for_backward(x, cos, sin)
    ctx.eager, ctx.backward, ctx.cos_at = eager, backward, 1


def _rotary_mul_backward(ctx, grad):
    x, cos, sin = ctx.saved_tensors
    (dx,), dcos, dsin = _rotation_grads(ctx, [(grad, x)], cos, sin)
    return dx, dcos, dsin, None, None


def _rope_qk_setup(ctx, inputs, output):
    q, k, cos, sin, eager, backward = inputs
    ctx.save_for_backward(q, k, cos, sin)
    ctx.eager, ctx.backward, ctx.cos_at = eager, backward, 2


def _rope_qk_backward(ctx, gq, gk):
    q, k, cos, sin = ctx.saved_tensors
    gq = torch.zeros_like(q) if gq is None else gq
    gk = torch.zeros_like(k) if gk is None else gk
    (dq, dk), dcos, dsin = _rotation_grads(ctx, [(gq, q), (gk, k)], cos, sin)
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
