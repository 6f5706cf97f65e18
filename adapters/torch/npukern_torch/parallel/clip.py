"""One global gradient norm over a model whose parameters are partly sharded
across ranks (a vocab-parallel embedding) and partly replicated."""

import math

import torch
import torch.distributed as dist


def _grads(params):
    if isinstance(params, torch.Tensor):
        params = [params]
    return [p.grad for p in params if p.grad is not None]


def _stats(grads):
    """[sum of squares of the finite elements, NaN count, Inf count] in f64."""
    if not grads:
        return torch.zeros(3, dtype=torch.float64)
    return torch.ops.npukern.grad_stats(grads)[:3].clone()


def clip_grad_norm_(sharded_params, max_norm, process_group=None, replicated_params=(), error_if_nonfinite=False):
    """``torch.nn.utils.clip_grad_norm_`` (L2) over a model split across
    `process_group`: `sharded_params` hold different values on each rank (each
    counted once, by its owner), `replicated_params` the same values on every
    rank (counted once). Returns the total norm as a float64 tensor, the same
    on every rank (computed in f64; cast it if torch's dtype is wanted).

    The sums of squares come from npukern's grad_stats (f64) and are
    all-reduced together with the NaN and Inf counts, so a non-finite value
    on any rank makes the norm NaN (or Inf) on all of them. Every gradient is
    then scaled in one pass by npukern's coefficient
    ``min(1, max_norm / (norm + 1e-6))`` (f64, rounded once to float32, each
    element rounded once), as ``npukern_torch.clip_grad_norm_`` does in one
    process. `error_if_nonfinite` raises RuntimeError on every rank, with no
    gradient changed. A negative or NaN `max_norm` raises ValueError."""
    max_norm = float(max_norm)
    if not max_norm >= 0.0:
        raise ValueError(f"max_norm must be >= 0, got {max_norm}")
    sharded, replicated = _grads(sharded_params), _grads(replicated_params)
    group = process_group if process_group is not None else dist.group.WORLD
    local = _stats(sharded)
    dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    total_stats = local + _stats(replicated)
    sum_sq, nans, infs = (v.item() for v in total_stats)
    total = math.nan if nans else (math.inf if infs else math.sqrt(sum_sq))
    if error_if_nonfinite and not math.isfinite(total):
        raise RuntimeError(
            f"The total norm of order 2.0 for gradients is non-finite ({total}), so it cannot be clipped; "
            "set error_if_nonfinite=False to scale the gradients by it anyway"
        )
    coef = max_norm / (total + 1e-6)
    coef = coef if math.isnan(coef) else min(1.0, coef)
    coef32 = float(torch.tensor(coef, dtype=torch.float32))
    grads = sharded + replicated
    if grads:
        torch._foreach_mul_(grads, coef32)
    return torch.tensor(total, dtype=torch.float64)
