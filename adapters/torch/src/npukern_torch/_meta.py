"""Fake (meta) implementations of the npukern:: ops: output shapes, dtypes and
strides without running a kernel, so FakeTensor tracing (torch.compile,
torch.export, torch.library.opcheck) sees through every op."""

import torch


def _rstd_shape(x, gamma):
    torch._check(
        1 <= gamma.dim() <= x.dim(),
        lambda: f"gamma has {gamma.dim()} dims; it must cover 1..{x.dim()} trailing dims of x",
    )
    return (*x.shape[: x.dim() - gamma.dim()], *([1] * gamma.dim()))


def _contiguous_like(t):
    return t.new_empty(t.shape)


@torch.library.register_fake("npukern::rms_norm")
def _rms_norm(x, gamma, epsilon=1e-6, gamma_offset=0.0, cast_before_gamma=False):
    return _contiguous_like(x), x.new_empty(_rstd_shape(x, gamma), dtype=torch.float32)


@torch.library.register_fake("npukern::add_rms_norm")
def _add_rms_norm(x1, x2, gamma, epsilon=1e-6, gamma_offset=0.0, cast_before_gamma=False):
    rstd = x1.new_empty(_rstd_shape(x1, gamma), dtype=torch.float32)
    return _contiguous_like(x1), rstd, _contiguous_like(x1)


@torch.library.register_fake("npukern::add_rms_norm_")
def _add_rms_norm_(x1, x2, gamma, epsilon=1e-6, gamma_offset=0.0, cast_before_gamma=False):
    # x1 is written in place (the kernel's rule); y and rstd are new.
    torch._check(x1.is_contiguous(), lambda: "npukern::add_rms_norm_: x1 must be contiguous")
    return _contiguous_like(x1), x1.new_empty(_rstd_shape(x1, gamma), dtype=torch.float32)


@torch.library.register_fake("npukern::rms_norm_backward")
def _rms_norm_backward(dy, x, gamma, rstd, gamma_offset=0.0):
    return _contiguous_like(x), gamma.new_empty(gamma.shape, dtype=torch.float32)


@torch.library.register_fake("npukern::add_rms_norm_backward")
def _add_rms_norm_backward(dy, x_sum, gamma, rstd, dx_sum, gamma_offset=0.0):
    return _contiguous_like(x_sum), gamma.new_empty(gamma.shape, dtype=torch.float32)


@torch.library.register_fake("npukern::embedding")
def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False):
    torch._check(weight.dim() == 2, lambda: "weight must be 2-D")
    return weight.new_empty((*indices.shape, weight.shape[1]))


@torch.library.register_fake("npukern::embedding_shard")
def _embedding_shard(weight, indices, num_embeddings, vocab_start, padding_idx=-1, scale_grad_by_freq=False):
    torch._check(weight.dim() == 2, lambda: "weight must be 2-D")
    return weight.new_empty((*indices.shape, weight.shape[1]))


@torch.library.register_fake("npukern::embedding_dense_backward")
def _embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq):
    return grad.new_empty((num_weights, grad.shape[-1]))


@torch.library.register_fake("npukern::embedding_dense_backward_shard")
def _embedding_dense_backward_shard(grad, indices, num_weights, vocab_start, padding_idx, scale_grad_by_freq):
    return grad.new_empty((num_weights, grad.shape[-1]))


def _scalar_device(grads):
    return grads[0].device if len(grads) else torch.device("cpu")


@torch.library.register_fake("npukern::grad_stats")
def _grad_stats(grads):
    return torch.empty(6, dtype=torch.float64, device=_scalar_device(grads))


@torch.library.register_fake("npukern::clip_grad_norm_")
def _clip_grad_norm_(grads, max_norm, error_if_nonfinite=False):
    return torch.empty((), dtype=torch.float64, device=_scalar_device(grads))


@torch.library.register_fake("npukern::adamw_")
def _adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, *args, **kwargs):
    return torch.empty(2, dtype=torch.float64, device=_scalar_device(params))


def _half_shape(x, dim):
    d = dim + x.dim() if dim < 0 else dim
    torch._check(0 <= d < x.dim(), lambda: f"dim {dim} is out of range for x of rank {x.dim()}")
    shape = list(x.shape)
    shape[d] = shape[d] // 2
    return shape


@torch.library.register_fake("npukern::swiglu")
def _swiglu(x, dim=-1, eager=False):
    return x.new_empty(_half_shape(x, dim))


@torch.library.register_fake("npukern::swiglu_backward")
def _swiglu_backward(grad_output, x, dim=-1, eager=False):
    return _contiguous_like(x)


@torch.library.register_fake("npukern::silu_mul")
def _silu_mul(gate, up, eager=False):
    return _contiguous_like(gate)


@torch.library.register_fake("npukern::silu_mul_backward")
def _silu_mul_backward(grad_output, gate, up, eager=False):
    return _contiguous_like(gate), _contiguous_like(gate)


@torch.library.register_fake("npukern::geglu")
def _geglu(x, dim=-1, approximate=1, activate_left=False, eager=False):
    return x.new_empty(_half_shape(x, dim)), x.new_empty(_half_shape(x, dim))


@torch.library.register_fake("npukern::geglu_backward")
def _geglu_backward(grad_output, x, dim=-1, approximate=1, activate_left=False, eager=False):
    return _contiguous_like(x)


@torch.library.register_fake("npukern::gelu_mul")
def _gelu_mul(gate, up, approximate=1, eager=False):
    return _contiguous_like(gate)


@torch.library.register_fake("npukern::gelu_mul_backward")
def _gelu_mul_backward(grad_output, gate, up, approximate=1, eager=False):
    return _contiguous_like(gate), _contiguous_like(gate)


@torch.library.register_fake("npukern::rotary_mul")
def _rotary_mul(x, r1, r2, eager=False, backward=False):
    return _contiguous_like(x)


@torch.library.register_fake("npukern::rope_qk")
def _rope_qk(q, k, cos, sin, eager=False, backward=False):
    return _contiguous_like(q), _contiguous_like(k)


@torch.library.register_fake("npukern::cross_entropy")
def _cross_entropy(logits, target, weight=None, reduction=2, ignore_index=-100, label_smoothing=0.0,
                   lse_square_scale=0.0, softcap=0.0):
    n = logits.shape[0]
    loss = logits.new_empty((n,) if reduction == 0 else (), dtype=torch.float32)
    return loss, logits.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("npukern::cross_entropy_backward")
def _cross_entropy_backward(grad, logits, target, weight, lse, reduction=2, ignore_index=-100, label_smoothing=0.0,
                            lse_square_scale=0.0, softcap=0.0):
    return _contiguous_like(logits)


@torch.library.register_fake("npukern::cross_entropy_train")
def _cross_entropy_train(logits, target, weight=None, reduction=2, ignore_index=-100, label_smoothing=0.0,
                         lse_square_scale=0.0, softcap=0.0):
    n = logits.shape[0]
    return (logits.new_empty((), dtype=torch.float32), logits.new_empty((n,), dtype=torch.float32),
            _contiguous_like(logits))


@torch.library.register_fake("npukern::cross_entropy_fused_")
def _cross_entropy_fused_(logits, target, weight, grad_scale, ignore_index=-100, label_smoothing=0.0,
                          lse_square_scale=0.0, softcap=0.0):
    n = logits.shape[0]
    return logits.new_empty((n,), dtype=torch.float32), logits.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("npukern::cross_entropy_reduce")
def _cross_entropy_reduce(loss_rows, target, weight=None, reduction=2, ignore_index=-100):
    return loss_rows.new_empty((), dtype=torch.float32)


@torch.library.register_fake("npukern::cross_entropy_grad_scale")
def _cross_entropy_grad_scale(target, weight=None, reduction=2, ignore_index=-100, grad=1.0):
    return target.new_empty((), dtype=torch.float32)


def _product_shape(a, b, trans_a, trans_b):
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "npukern::matmul: a and b must be 2-D")
    m, ka = (a.shape[1], a.shape[0]) if trans_a else (a.shape[0], a.shape[1])
    kb, n = (b.shape[1], b.shape[0]) if trans_b else (b.shape[0], b.shape[1])
    torch._check(ka == kb, lambda: f"npukern::matmul: a's summed dimension is {ka} and b's {kb}")
    return m, n


def _check_math(a, b, math):
    torch._check(math in (0, 1, 2), lambda: f"npukern::matmul: math must be 0 (the FMA chain), 1 (the bf16 pair "
                                            f"dot) or 2 (Arm's bf16 pair dot), got {math}")
    torch._check(math == 0 or (a.dtype == b.dtype == torch.bfloat16),
                 lambda: f"npukern::matmul: math={math} (a bf16 pair dot) takes bfloat16 operands, got {a.dtype} "
                         f"and {b.dtype}")


@torch.library.register_fake("npukern::matmul")
def _matmul(a, b, trans_a=False, trans_b=False, out_dtype=None, math=0):
    _check_math(a, b, math)
    return a.new_empty(_product_shape(a, b, trans_a, trans_b), dtype=out_dtype or a.dtype)


@torch.library.register_fake("npukern::matmul_accumulate_")
def _matmul_accumulate_(c, a, b, trans_a=False, trans_b=False, math=0):
    _product_shape(a, b, trans_a, trans_b)
    _check_math(a, b, math)


@torch.library.register_fake("npukern::linear")
def _linear(input, weight, bias=None, math=0):
    _check_math(input, weight, math)
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


def _attention_bsnd(q, k, v):
    """Whether the CPU kernel reads q, k, v as BSND (csrc/attention_ops.cpp):
    not all contiguous, all the transpose(1, 2) of contiguous tensors. Its
    outputs then are such views too: the fake ones must have their strides."""
    if all(t.is_contiguous() for t in (q, k, v)):
        return False
    return all(t.dim() == 4 and t.transpose(1, 2).is_contiguous() for t in (q, k, v))


def _attention_like(t, bsnd):
    if bsnd:
        return t.new_empty((t.shape[0], t.shape[2], t.shape[1], t.shape[3])).transpose(1, 2)
    return t.new_empty(t.shape)


def _attention_check(q, k, v):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "npukern::attention: q, k, v must be 4-D [batch, heads, seq, head_dim]")
    torch._check(k.shape == v.shape, lambda: f"npukern::attention: v's shape {tuple(v.shape)} is not k's")
    torch._check(q.dtype == k.dtype == v.dtype, lambda: "npukern::attention: q, k, v must share a dtype")


@torch.library.register_fake("npukern::attention")
def _attention(q, k, v, is_causal=False, scale=None):
    _attention_check(q, k, v)
    stats = q.new_empty(q.shape[:3], dtype=torch.float32)
    return _attention_like(q, _attention_bsnd(q, k, v)), stats, stats.new_empty(stats.shape)


@torch.library.register_fake("npukern::attention_backward")
def _attention_backward(dout, q, k, v, out, softmax_max, softmax_sum, is_causal=False, scale=None):
    _attention_check(q, k, v)
    bsnd = _attention_bsnd(q, k, v)
    return _attention_like(q, bsnd), _attention_like(k, bsnd), _attention_like(v, bsnd)
