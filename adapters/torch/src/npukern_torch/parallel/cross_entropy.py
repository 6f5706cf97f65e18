"""Cross-entropy over logits split by vocabulary across the ranks of a
process group (Megatron-LM's ``vocab_parallel_cross_entropy``, in
:class:`VocabParallelEmbedding`'s layout), and the LM head fused with it.

Determinism: no partial quantity goes through an all-reduce (SUM), whose
summation order is the backend's business. Each rank computes per-row
partials of its shard -- its max ``m_r``, ``sum exp(x - m_r)``, ``sum (m_r -
x)`` and the target's logit (0 when the target lies elsewhere) -- the ranks
all-gather them, and every rank combines them in rank order 0..world-1 with
the same float32 ops (float64 for float64 logits): the global log-sum-exp
is the same bits on every rank and on every run (with the same thread
settings: torch's own row reductions are what each rank's partials use).
The arithmetic mirrors what ``F.cross_entropy`` does in one process
(``logp = (x - max) - log(sum exp(x - max))``, its nll and label-smoothing
terms and reductions, its autograd's log-softmax backward), so the result
differs from the single-process one only by where the sum of exponentials
is split (torch ops throughout, rather than npukern's one-pass kernel,
whose online log-sum-exp rounds along another path)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import loss as _loss_mod
from . import _agree
from .embedding import _indices_check, vocab_range

_REDUCTIONS = ("none", "sum", "mean")
# Rows of the per-rank partials tensor [4, N].
_MAX, _SUMEXP, _BELOW, _TARGET = range(4)
# Fields each rank reports before the loss's own collectives (after _agree's slots).
_V_LOCAL, _ROWS, _CHECK, _T_MIN, _T_MAX, _WANTS = range(6)


def _compute_dtype(dtype):
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        return torch.float32
    if dtype == torch.float64:
        return torch.float64
    raise TypeError(f"logits must be float32, float16, bfloat16 or float64, got {dtype}")


def _group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("vocab-parallel cross-entropy needs an initialized torch.distributed process group")
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def _check_args(reduction, label_smoothing):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")


def _check_target(target):
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be int64 or int32 class ids, got {target.dtype}")


def _target_fields(t, ignore_index):
    """The target's checksum and the smallest and largest id not ignored."""
    kept = t[t != ignore_index]
    lo, hi = (float(kept.min()), float(kept.max())) if kept.numel() else (0.0, 0.0)
    return _indices_check(t), lo, hi


def _agree_on(where, group, world, error, fields):
    """All-gathers every rank's outcome and fields ([world, len(fields)]
    float64): every rank raises together when any rank failed."""
    mine = torch.tensor([*_agree.encode(error), *fields], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    meta = torch.stack(rows)
    _agree.raise_if_any(meta[:, : _agree.SLOTS].sum(0), error, where)
    return meta[:, _agree.SLOTS :]


def _validate(where, meta, t, ignore_index, rank, world):
    """From the gathered fields (the same on every rank, so every rank
    decides the same): the ranks' targets agree, the shards follow
    vocab_range, the targets are in range. Returns (vocab, vocab_start,
    sizes of every rank's shard)."""
    rows, checks = meta[:, _ROWS], meta[:, _CHECK]
    if not (bool((rows == rows[0]).all()) and bool((checks == checks[0]).all())):
        raise ValueError(_DIFFERENT_TARGETS.format(where=where))
    sizes = [int(v) for v in meta[:, _V_LOCAL].tolist()]
    vocab = sum(sizes)
    expect = [e - s for s, e in (vocab_range(vocab, r, world) for r in range(world))]
    if vocab == 0 or sizes != expect:
        raise ValueError(f"{where}: the shards have {sizes} classes; for a vocabulary of {vocab} the layout of "
                         f"npukern_torch.parallel.vocab_range needs {expect}")
    if float(meta[:, _T_MIN].min()) < 0 or float(meta[:, _T_MAX].max()) >= vocab:
        bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(f"{where}: target row {row} (flat) is {int(t[row])}, out of range for the "
                             f"global vocabulary of {vocab} classes (ignore_index {ignore_index})")
        raise ValueError(f"{where}: another rank's target is out of range for the global vocabulary of {vocab}")
    return vocab, vocab_range(vocab, rank, world)[0], sizes


_DIFFERENT_TARGETS = ("{where}: the ranks passed different targets; every rank of the group must pass the same "
                      "target (the vocab-parallel layout's precondition, as in Megatron-LM)")


def _same_targets(where, group, t):
    """Exactly the same targets on every rank (after ``_validate``: the same
    count everywhere): rank 0's are broadcast, each rank compares its own
    with them, and the verdict is all-reduced, so every rank raises together
    (the checksum alone missed swapped rows and ids 65 521 apart)."""
    ref = t.contiguous().clone()
    dist.broadcast(ref, src=dist.get_global_rank(group, 0), group=group)
    differ = torch.tensor([0.0 if torch.equal(ref, t) else 1.0], dtype=torch.float64)
    dist.all_reduce(differ, op=dist.ReduceOp.SUM, group=group)
    if differ.item():
        raise ValueError(_DIFFERENT_TARGETS.format(where=where))


def _partials(x, t, start, ignore_index, out, smoothing):
    """Writes this shard's per-row partials of `x` ([n, V_local], compute
    dtype) into `out` ([4, n]): the max m, sum exp(x - m), sum (m - x) (label
    smoothing only, else 0), and the target's logit where the target is in
    the shard (0 elsewhere)."""
    n, v = x.shape
    if v == 0:
        out[_MAX] = float("-inf")
        out[_SUMEXP:] = 0
        return
    m = x.amax(1)
    # A row of -inf: subtract 0 instead (exp gives 0, not exp(NaN)).
    ms = torch.where(m == float("-inf"), torch.zeros_like(m), m)[:, None]
    out[_MAX] = m
    out[_SUMEXP] = torch.exp(x - ms).sum(1)
    out[_BELOW] = (ms - x).sum(1) if smoothing else 0
    local = t - start
    inside = (local >= 0) & (local < v) & (t != ignore_index)
    out[_TARGET] = torch.where(inside, x.gather(1, torch.where(inside, local, 0)[:, None])[:, 0], 0)


def _combine(group, world, parts, sizes, smoothing):
    """All-gathers the [4, n] partials and combines them in rank order:
    (max, log sum exp(x - max), target logit, sum over classes of (max - x))
    per row, the same bits on every rank."""
    gathered = [torch.empty_like(parts) for _ in range(world)]
    dist.all_gather(gathered, parts, group=group)
    big = torch.stack([g[_MAX] for g in gathered]).amax(0)  # exact
    shift = torch.where(big == float("-inf"), torch.zeros_like(big), big)
    total, target, below = torch.zeros_like(big), torch.zeros_like(big), torch.zeros_like(big)
    for g, size in zip(gathered, sizes):
        total = total + g[_SUMEXP] * torch.exp(g[_MAX] - shift)
        target = target + g[_TARGET]  # one rank's logit, zeros from the others: exact
        if smoothing and size:
            below = below + (size * (big - g[_MAX]) + g[_BELOW])
    return big, torch.log(total), target, below


def _loss(big, log_sum, target_logit, below, keep, vocab, reduction, eps):
    """F.cross_entropy's loss from the combined rows, in its order of
    operations: nll through torch's own nll_loss reduction (the same
    summation order), the label-smoothing term ``-sum_j logp_j`` reduced
    like torch's, then ``(1 - eps) * nll + smooth * (eps / C)``."""
    logp_t = (target_logit - big) - log_sum
    column = torch.where(keep, 0, -1)
    nll = F.nll_loss(logp_t[:, None], column, ignore_index=-1, reduction=reduction)
    if not eps:
        return nll
    smooth = (log_sum * vocab + below).masked_fill(~keep, 0.0)
    if reduction == "mean":
        smooth = smooth.sum() / keep.sum()
    elif reduction == "sum":
        smooth = smooth.sum()
    return (1 - eps) * nll + smooth * (eps / vocab)


def _row_coefs(up, keep, reduction, eps, vocab):
    """dloss/dlogp per row as torch's autograd forms it: ``at`` at the
    target's class, ``every`` at each class (0 on ignored rows), and their
    sum over the classes. `up` is the upstream gradient (a scalar, or [n]
    for reduction none)."""
    zero = torch.zeros_like(keep, dtype=up.dtype)
    count = keep.sum().to(up.dtype)
    g_nll = up * (1 - eps) if eps else up
    at = -(g_nll / count) if reduction == "mean" else -g_nll
    at = torch.where(keep, at, zero)
    if not eps:
        return at, zero, at
    g_smooth = up * (eps / vocab)
    every = -(g_smooth / count) if reduction == "mean" else -g_smooth
    every = torch.where(keep, every, zero)
    return at + every, every, at + every * vocab


def _shard_grad(x, big, log_sum, at, every, total, t, start, ignore_index, overwrite=False):
    """The shard's gradient ([n, V_local], x's dtype = the compute dtype):
    torch's log-softmax backward ``g - exp(logp) * sum(g)`` with ``logp = (x
    - max) - log_sum``, g = `every` everywhere and `at` at the target.
    `overwrite`: x is a temporary, turned into the gradient in place."""
    p = (x if overwrite else x.clone()).sub_(big[:, None]).sub_(log_sum[:, None]).exp_()
    local = t - start
    inside = (local >= 0) & (local < x.shape[1]) & (t != ignore_index)
    rows = inside.nonzero()[:, 0]
    cols = local[rows]
    p_t = p[rows, cols]
    grad = p.mul_(total[:, None]).neg_().add_(every[:, None])  # every - p * total
    grad[rows, cols] = at[rows] - p_t * total[rows]
    return grad


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Forward: partials, the gathered combination, the loss; backward: each
    shard's gradient from the saved global max and log-sum-exp."""

    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, reduction, eps):
        where = "vocab_parallel_cross_entropy"
        group, rank, world = _group(group)
        error, fields, x, t = None, [0.0] * 6, None, None
        try:
            _check_args(reduction, eps)
            _check_target(target)
            acc = _compute_dtype(logits.dtype)
            if logits.dim() < 1 or tuple(target.shape) != tuple(logits.shape[:-1]):
                raise ValueError(f"logits_shard {tuple(logits.shape)} needs target of shape "
                                 f"{tuple(logits.shape[:-1])}, got {tuple(target.shape)}")
            x = logits.reshape(target.numel(), logits.shape[-1])  # (not -1: an empty shard has 0 classes)
            t = target.reshape(-1).long()
            fields = [x.shape[1], x.shape[0], *_target_fields(t, ignore_index), 0.0]
        except Exception as e:  # noqa: BLE001  (reported on every rank below)
            error = e
        meta = _agree_on(where, group, world, error, fields)
        vocab, start, sizes = _validate(where, meta, t, ignore_index, rank, world)
        _same_targets(where, group, t)
        parts = torch.empty((4, x.shape[0]), dtype=acc)
        _partials(x.to(acc), t, start, ignore_index, parts, eps)
        big, log_sum, target_logit, below = _combine(group, world, parts, sizes, eps)
        keep = t != ignore_index
        loss = _loss(big, log_sum, target_logit, below, keep, vocab, reduction, eps)
        ctx.save_for_backward(logits, t, big, log_sum)
        ctx.args = (start, vocab, ignore_index, reduction, eps)
        return loss.reshape(target.shape) if reduction == "none" else loss

    @staticmethod
    def backward(ctx, grad):
        logits, t, big, log_sum = ctx.saved_tensors
        start, vocab, ignore_index, reduction, eps = ctx.args
        up = grad.reshape(-1) if reduction == "none" else grad.reshape(())
        at, every, total = _row_coefs(up, t != ignore_index, reduction, eps, vocab)
        x = logits.reshape(t.numel(), logits.shape[-1])
        upcast = x.dtype != big.dtype  # then x.to() is already a copy to overwrite
        dx = _shard_grad(x.to(big.dtype), big, log_sum, at, every, total, t, start, ignore_index, overwrite=upcast)
        return dx.to(logits.dtype).reshape(logits.shape), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard, target, *, group=None, ignore_index=-100, reduction="mean",
                                 label_smoothing=0.0):
    """``F.cross_entropy(full_logits.float(), target, ...)`` where rank r of
    `group` (default: the world) holds the classes ``[vocab_start,
    vocab_end)`` of :func:`vocab_range` (the global vocabulary is the sum of
    the shards' sizes): ``logits_shard`` ``[..., V_local]`` (classes last;
    float32, float16 or bfloat16, computed in float32; float64 in float64),
    ``target`` ``[...]`` global class ids (int64 or int32), the same on
    every rank. Returns the float32 loss on every rank: reduction "none"
    (``target``'s shape), "sum" or "mean" (over the rows not ignored; NaN
    when every row is ignored), ``label_smoothing`` as torch's.

    Differentiable in ``logits_shard``: each element's gradient is computed
    locally from the global max and log-sum-exp, as the single-process
    log-softmax backward computes it (``softmax - (1 - eps) * onehot - eps /
    C``, times the upstream gradient, divided by the count for "mean").

    Deterministic: the per-row partials are all-gathered and combined in rank
    order, never all-reduced (SUM), so the loss and the log-sum-exp are the
    same bits on every rank and every run. Every rank validates before the
    collectives and all raise together: a target out of range (negative
    other than ``ignore_index``, or ``>= C``) raises ValueError naming the
    row and value; different targets on different ranks, or shards not in
    vocab_range's layout, raise ValueError."""
    return _VocabParallelCrossEntropy.apply(logits_shard, target, group, ignore_index, reduction,
                                            float(label_smoothing))


def _row_chunks(n, rows):
    return ((s, min(n, s + rows)) for s in range(0, n, rows))


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    """Forward: pass 1 over chunks of tokens (each chunk's logits, its
    partials), the gathered combination and the loss; pass 2 recomputes each
    chunk's logits, turns them into dlogits and accumulates d_weight (this
    shard's) and this rank's partial d_input (float32); the partial d_inputs
    are all-gathered and summed in rank order. Backward scales the saved
    gradients by the upstream one (rounding 16-bit ones once)."""

    @staticmethod
    def forward(ctx, input, weight, target, group, ignore_index, reduction, eps, chunk_bytes, wants_grad):
        where = "vocab_parallel_linear_cross_entropy"
        group, rank, world = _group(group)
        need_input, need_weight = wants_grad and ctx.needs_input_grad[0], wants_grad and ctx.needs_input_grad[1]
        error, fields, x, t = None, [0.0] * 6, None, None
        try:
            _check_args(reduction, eps)
            if reduction == "none":
                raise ValueError(f"{where}: reduction='none' is not supported (use 'sum' or 'mean')")
            _check_target(target)
            acc = _compute_dtype(input.dtype)
            if weight.dtype != input.dtype:
                raise TypeError(f"{where}: input is {input.dtype}, weight_shard {weight.dtype}")
            if weight.dim() != 2 or input.dim() < 1 or weight.shape[1] != input.shape[-1]:
                raise ValueError(f"{where}: input {tuple(input.shape)} and weight_shard {tuple(weight.shape)} "
                                 "need input [..., H] and weight_shard [V_local, H]")
            if tuple(target.shape) != tuple(input.shape[:-1]):
                raise ValueError(f"{where}: input {tuple(input.shape)} needs target of shape "
                                 f"{tuple(input.shape[:-1])}, got {tuple(target.shape)}")
            if int(chunk_bytes) < 1:
                raise ValueError(f"{where}: chunk_bytes must be positive, got {chunk_bytes}")
            x = input.reshape(target.numel(), input.shape[-1])
            t = target.reshape(-1).long()
            fields = [weight.shape[0], x.shape[0], *_target_fields(t, ignore_index), float(need_input)]
        except Exception as e:  # noqa: BLE001  (reported on every rank below)
            error = e
        meta = _agree_on(where, group, world, error, fields)
        vocab, start, sizes = _validate(where, meta, t, ignore_index, rank, world)
        _same_targets(where, group, t)
        gather_input = bool(meta[:, _WANTS].any())  # every rank joins the d_input gather, or none

        n, hidden, v = x.shape[0], x.shape[1], weight.shape[0]
        w = weight.to(acc)  # 16-bit weights: float32 logits and gradients (one copy of the shard)
        itemsize = torch.empty((), dtype=acc).element_size()
        rows = max(1, min(n, int(chunk_bytes) // max(1, v * itemsize)))
        parts = torch.empty((4, n), dtype=acc)
        for s, e in _row_chunks(n, rows):
            _partials(x[s:e].to(acc) @ w.t(), t[s:e], start, ignore_index, parts[:, s:e], eps)
        big, log_sum, target_logit, below = _combine(group, world, parts, sizes, eps)
        keep = t != ignore_index
        loss = _loss(big, log_sum, target_logit, below, keep, vocab, reduction, eps)

        d_input = d_weight = None
        if need_weight or gather_input:
            at, every, total = _row_coefs(torch.ones((), dtype=acc), keep, reduction, eps, vocab)
            partial = torch.zeros((n, hidden), dtype=acc) if gather_input else None
            d_weight = torch.zeros((v, hidden), dtype=acc) if need_weight else None
            for s, e in _row_chunks(n, rows):
                xc = x[s:e].to(acc)
                dlogits = _shard_grad(xc @ w.t(), big[s:e], log_sum[s:e], at[s:e], every[s:e], total[s:e],
                                      t[s:e], start, ignore_index, overwrite=True)
                if partial is not None:
                    torch.mm(dlogits, w, out=partial[s:e])
                if d_weight is not None:
                    d_weight.addmm_(dlogits.t(), xc)
            if partial is not None:
                d_input = _sum_in_rank_order(group, world, partial, chunk_bytes)
        ctx.shape = input.shape
        ctx.dtypes = (input.dtype, weight.dtype)
        ctx.save_for_backward(d_input if need_input else None, d_weight)
        return loss

    @staticmethod
    def backward(ctx, grad):
        d_input, d_weight = ctx.saved_tensors
        in_dtype, w_dtype = ctx.dtypes
        g = grad.reshape(())
        di = (d_input * g.to(d_input.dtype)).to(in_dtype).reshape(ctx.shape) if d_input is not None else None
        dw = (d_weight * g.to(d_weight.dtype)).to(w_dtype) if d_weight is not None else None
        return di, dw, None, None, None, None, None, None, None


def _sum_in_rank_order(group, world, partial, chunk_bytes):
    """sum over ranks of `partial` ([n, H]), identical on every rank: gathered
    in slices of rows (world copies of a slice within chunk_bytes) and added
    in rank order."""
    n, hidden = partial.shape
    out = torch.empty_like(partial)
    rows = max(1, min(n, int(chunk_bytes) // max(1, world * hidden * partial.element_size())))
    for s, e in _row_chunks(n, rows):
        mine = partial[s:e].contiguous()
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        out[s:e] = total
    return out


def vocab_parallel_linear_cross_entropy(input, weight_shard, target, *, group=None, ignore_index=-100,
                                        reduction="mean", label_smoothing=0.0, chunk_bytes=None):
    """:func:`vocab_parallel_cross_entropy` of ``input @ weight_shard.T``
    without the ``[N, V_local]`` logits: ``input`` ``[..., H]`` is
    replicated on every rank (Megatron's LM head), ``weight_shard``
    ``[V_local, H]`` is this rank's rows of the output embedding (the
    vocab_range layout), ``target`` ``[...]`` global class ids. Chunks of
    tokens, each chunk's logits (``chunk_bytes`` of float32 at most, default
    ``npukern_torch.loss.CHUNK_BYTES``) computed twice: once for the loss's
    partials, once, after the global log-sum-exp is known, for dlogits.
    Returns the float32 loss (reduction "sum" or "mean"; "none" is not
    offered, as in ``linear_cross_entropy``).

    Gradients: ``weight_shard``'s is this rank's rows of the single-process
    weight gradient; ``input``'s is the sum over ranks of each rank's
    partial ``dlogits @ weight_shard`` (Megatron's all-reduce), all-gathered
    and added in rank order so it is the same bits on every rank and run.
    16-bit inputs and weights: logits and gradients in float32 (one float32
    copy of the shard), each gradient rounded once."""
    wants = torch.is_grad_enabled() and (input.requires_grad or weight_shard.requires_grad)
    return _VocabParallelLinearCrossEntropy.apply(
        input, weight_shard, target, group, ignore_index, reduction, float(label_smoothing),
        chunk_bytes or _loss_mod.CHUNK_BYTES, wants)
