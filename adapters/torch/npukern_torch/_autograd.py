"""Autograd formulas of the forward ops, registered with torch.library so that
autograd (and AOTAutograd under torch.compile) works on the ops themselves:
each forward saves what its backward op needs (x or x_sum, gamma, rstd;
the indices), and the backward calls npukern's backward op. rstd is an
auxiliary output and not differentiable (as in torch_npu)."""

import torch

ops = torch.ops.npukern


def _cast_dgamma(dgamma, gamma):
    # The kernel's dgamma is f32 (the main-grad dtype); autograd needs gamma's.
    return dgamma if dgamma.dtype == gamma.dtype else dgamma.to(gamma.dtype)


def _rms_norm_setup(ctx, inputs, output):
    x, gamma, _eps = inputs
    _y, rstd = output
    ctx.save_for_backward(x, gamma, rstd)
    ctx.mark_non_differentiable(rstd)


def _rms_norm_backward(ctx, dy, _drstd):
    x, gamma, rstd = ctx.saved_tensors
    dx, dgamma = ops.rms_norm_backward(dy, x, gamma, rstd)
    return dx, _cast_dgamma(dgamma, gamma), None


def _add_rms_norm_setup(ctx, inputs, output):
    _x1, _x2, gamma, _eps = inputs
    _y, rstd, x_sum = output
    ctx.save_for_backward(x_sum, gamma, rstd)
    ctx.mark_non_differentiable(rstd)


def _add_rms_norm_backward(ctx, dy, _drstd, dx_sum):
    x_sum, gamma, rstd = ctx.saved_tensors
    dx, dgamma = ops.add_rms_norm_backward(dy, x_sum, gamma, rstd, dx_sum)
    # x_sum = x1 + x2: both addends get the same gradient.
    return dx, dx, _cast_dgamma(dgamma, gamma), None


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


torch.library.register_autograd("npukern::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
torch.library.register_autograd("npukern::add_rms_norm", _add_rms_norm_backward, setup_context=_add_rms_norm_setup)
torch.library.register_autograd("npukern::embedding", _embedding_backward, setup_context=_embedding_setup)
torch.library.register_autograd(
    "npukern::embedding_shard", _embedding_shard_backward, setup_context=_embedding_shard_setup
)
