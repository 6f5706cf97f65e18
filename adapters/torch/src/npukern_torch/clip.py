"""torch.nn.utils.clip_grad_norm_ on npukern's clip_grad_norm (L2): one read
of every gradient for the norm (f64 sum of squares), one pass to scale."""

import functools

import torch

from ._dtypes import KERNEL_DTYPES


def as_list(parameters):
    """`parameters` as a list, read once: torch passes generators
    (``model.parameters()``), and a generator read twice is empty the second
    time -- so every path (ours and torch's hand-off) works on this list."""
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    return list(parameters)


def total_norm_dtype(grads):
    """The dtype torch's clip_grad_norm_ returns its norm in (per-tensor norms
    in each gradient's dtype, stacked with type promotion)."""
    return functools.reduce(torch.promote_types, (g.dtype for g in grads))


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """``torch.nn.utils.clip_grad_norm_`` for ``norm_type=2``: returns the total
    L2 norm of all gradients (as a tensor of the dtype torch returns) and
    scales every gradient in place by ``min(1, max_norm / (norm + 1e-6))``.

    Differences, by decision: the norm is computed exactly in f64 (torch sums
    per-tensor norms in the gradients' dtype) and the coefficient in f64,
    rounded once to float32; the norm is returned as float32 also for lists of
    only 16-bit gradients (see :func:`returned_norm_dtype`), and the gradients
    are always scaled by the coefficient of the returned value; a negative or NaN ``max_norm`` raises ValueError
    (torch silently flips or NaNs the gradients). ``error_if_nonfinite`` raises
    RuntimeError, as torch does, with every gradient left untouched.
    Other norm types, and gradients the kernels do not take (float64, sparse,
    non-CPU), go to torch's own function. ``foreach`` is accepted for
    compatibility and otherwise ignored (npukern always does one pass)."""
    params = as_list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    norm_type = float(norm_type)
    if norm_type != 2.0 or any(g.device.type != "cpu" or g.is_sparse or g.dtype not in KERNEL_DTYPES for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    if not grads:
        return torch.tensor(0.0)
    total = torch.ops.npukern.clip_grad_norm_(grads, float(max_norm), bool(error_if_nonfinite))
    norm = total.to(returned_norm_dtype(grads))
    if torch.isinf(norm) and torch.isfinite(total):
        # Only a float32 norm beyond 3.4e38 gets here: the returned norm is
        # inf, so the coefficient that goes with it is max_norm / inf = 0
        # (torch's result too); the kernel had scaled by the finite one.
        torch._foreach_mul_(grads, 0.0)
    return norm


def returned_norm_dtype(grads):
    """The dtype of the returned norm: torch's (the gradients' promoted dtype)
    promoted with float32, so float32 for every list the kernels take. A list
    of only float16 (or bfloat16) gradients gets a float32 norm where torch
    returns a float16 one: the exact norm of float16 gradients routinely
    exceeds float16's 65504, and torch then returns inf and zeroes every
    gradient, while npukern returns the exact norm and scales by the
    coefficient of that very value (review defect 8)."""
    return torch.promote_types(total_norm_dtype(grads), torch.float32)
