"""One global gradient norm over a model whose parameters are partly sharded
across ranks (a vocab-parallel embedding) and partly replicated."""

import math

import torch
import torch.distributed as dist

from ..clip import as_list
from . import _agree

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _grads(params):
    return [p.grad for p in as_list(params) if p.grad is not None]


def _on_kernels(g):
    return g.device.type == "cpu" and not g.is_sparse and g.dtype in _KERNEL_DTYPES


def _stats(grads):
    """[sum of squares of the finite elements, NaN count, Inf count] in f64:
    npukern's grad_stats for the gradients its kernels take, torch in float64
    for the others (float64, sparse or non-CPU gradients) -- the same split as
    the single-process ``npukern_torch.clip_grad_norm_``, which hands those
    to torch."""
    kernel = [g for g in grads if _on_kernels(g)]
    stats = torch.ops.npukern.grad_stats(kernel)[:3].clone() if kernel else torch.zeros(3, dtype=torch.float64)
    for g in grads:
        if _on_kernels(g):
            continue
        if not g.is_floating_point():
            raise TypeError(f"npukern_torch.parallel.clip_grad_norm_: a gradient has dtype {g.dtype}")
        v = (g.coalesce().values() if g.is_sparse else g).detach().double().reshape(-1)
        finite = torch.isfinite(v)
        stats += torch.stack([v[finite].square().sum(), torch.isnan(v).sum(), torch.isinf(v).sum()]).cpu().double()
    return stats


def clip_grad_norm_(sharded_params, max_norm, process_group=None, replicated_params=(), error_if_nonfinite=False):
    """``torch.nn.utils.clip_grad_norm_`` (L2) over a model split across
    `process_group`: `sharded_params` hold different values on each rank (each
    counted once, by its owner), `replicated_params` the same values on every
    rank (counted once). Returns the total norm as a float64 tensor, the same
    on every rank (computed in f64; cast it if torch's dtype is wanted).

    The sums of squares come from npukern's grad_stats (f64; torch in f64 for
    float64, sparse and non-CPU gradients, as in one process) and are
    all-reduced together with the NaN and Inf counts, so a non-finite value
    on any rank makes the norm NaN (or Inf) on all of them. Every gradient is
    then scaled in one pass by npukern's coefficient
    ``min(1, max_norm / (norm + 1e-6))`` (f64, rounded once to float32, each
    element rounded once), as ``npukern_torch.clip_grad_norm_`` does in one
    process. `error_if_nonfinite` raises RuntimeError on every rank, with no
    gradient changed. A negative or NaN `max_norm` raises ValueError.

    Preconditions: every rank of the group calls it at the same step.
    Failures of one rank's own inputs (a bad `max_norm`, an unsupported
    gradient) ride on the norm's all-reduce: every rank raises the same
    exception type together, none is left waiting, and no gradient is changed."""
    where = "npukern_torch.parallel.clip_grad_norm_"
    error, sharded, replicated = None, [], []
    local, mine = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    try:
        max_norm = float(max_norm)
        if not max_norm >= 0.0:
            raise ValueError(f"max_norm must be >= 0, got {max_norm}")
        sharded, replicated = _grads(sharded_params), _grads(replicated_params)
        local, mine = _stats(sharded), _stats(replicated)
    except Exception as e:  # noqa: BLE001  (reported on every rank below)
        error = e
    group = process_group if process_group is not None else dist.group.WORLD
    reduced = torch.cat([local, torch.tensor(_agree.encode(error), dtype=torch.float64)])
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
    _agree.raise_if_any(reduced[3:], error, where)
    total_stats = reduced[:3] + mine
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
