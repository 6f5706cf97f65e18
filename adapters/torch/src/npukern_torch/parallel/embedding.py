"""VocabParallelEmbedding: the embedding table split by vocabulary range
over the ranks of a process group."""

import torch
import torch.distributed as dist

from ..functional import normalize_padding_idx
from . import _agree

_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Indices checksum modulus: c < 2^24, so c^2 summed over up to 2^5 ranks is exact in f64.
_CHECK_MOD = 1 << 24


def _indices_check(indices):
    """A position-weighted checksum of the ids (with their count): equal on
    ranks with equal indices. Ranks compare it with two sums, sum(c) and
    sum(c^2): ``world * sum(c^2) == sum(c)^2`` exactly when every rank's c is
    the same (Cauchy-Schwarz), with no extra collective."""
    flat = indices.reshape(-1).long()
    weights = torch.arange(flat.numel(), dtype=torch.long, device=flat.device) % 251 + 1
    c = (int(((flat % 65521) * weights).sum()) + 7919 * flat.numel()) % _CHECK_MOD
    return float(c)


class _ShardLookupTorch(torch.autograd.Function):
    """The shard's lookup and its weight gradient in torch ops, for weights
    the kernels do not take (float64, non-CPU): the same rule as the
    single-process Embedding, which runs torch's embedding for them. Rows out
    of the shard are zero; the gradient skips them and the padding id, and
    divides by each id's count over all positions when scale_grad_by_freq."""

    @staticmethod
    def forward(ctx, weight, indices, vocab_start, padding_idx, scale_grad_by_freq):
        flat = indices.reshape(-1).long()
        local = flat - vocab_start
        inside = (local >= 0) & (local < weight.shape[0])
        shape = (*indices.shape, weight.shape[1])
        rows = weight.index_select(0, torch.where(inside, local, torch.zeros_like(local))).reshape(shape)
        ctx.save_for_backward(indices)
        ctx.args = (weight.shape[0], vocab_start, padding_idx, scale_grad_by_freq)
        # A fresh tensor, not a view: the all-reduce writes into it in place.
        return torch.where(inside.reshape(*indices.shape, 1), rows, torch.zeros_like(rows))

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        rows, vocab_start, padding_idx, scale_grad_by_freq = ctx.args
        flat = indices.reshape(-1).long()
        g = grad.reshape(flat.numel(), -1)
        if scale_grad_by_freq:
            _, inverse, counts = torch.unique(flat, return_inverse=True, return_counts=True)
            g = g / counts[inverse].unsqueeze(-1).to(g.dtype)
        local = flat - vocab_start
        keep = (local >= 0) & (local < rows) & (flat != padding_idx)
        dw = g.new_zeros((rows, g.shape[1]))
        dw.index_add_(0, local[keep], g[keep])
        return dw, None, None, None, None


def vocab_range(num_embeddings: int, rank: int, world_size: int):
    """``(vocab_start, vocab_end)`` of `rank`: contiguous ranges, as even as
    possible (the first ``num_embeddings % world_size`` ranks get one row more)."""
    if world_size < 1 or not 0 <= rank < world_size or num_embeddings < 0:
        raise ValueError(f"no rank {rank} of {world_size} for {num_embeddings} rows")
    base, extra = divmod(num_embeddings, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class _SumOverGroup(torch.autograd.Function):
    """Forward: all-reduce (sum) of the masked partial lookups, completing
    every row on every rank. Backward: identity -- the output is replicated,
    so each rank's upstream gradient is already the whole gradient
    (Megatron's reduce-from-model-parallel region)."""

    @staticmethod
    def forward(ctx, partial, group):
        ctx.mark_dirty(partial)
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
        return partial

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class VocabParallelEmbedding(torch.nn.Module):
    """An embedding whose table is split by vocabulary over `process_group`
    (default: the world). ``weight`` is this rank's shard
    ``[vocab_end - vocab_start, embedding_dim]``.

    Forward: ids outside the shard are masked (their rows are zero), then an
    all-reduce sums the ranks' partial lookups; adding zeros is exact, so the
    output equals the unsharded lookup bit for bit. Backward: npukern's
    EmbeddingDenseGrad of this shard (``vocab_start``, out-of-shard ids
    ignored). ``padding_idx`` (negative counts from the end) and
    ``scale_grad_by_freq`` mean what they mean unsharded: every rank sees all
    positions, so the per-id counts are over all of them. Every rank checks
    every id against ``[0, num_embeddings)`` before the collective, so a bad id
    raises IndexError on every rank instead of leaving one rank hanging.

    The shard is initialized N(0, 1) with the padding row zeroed, as
    torch.nn.Embedding; :meth:`load_full_weight_` loads a full table and
    :meth:`full_weight` gathers it back (checkpoints)."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None, scale_grad_by_freq=False,
                 process_group=None, device=None, dtype=None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("VocabParallelEmbedding needs an initialized torch.distributed process group")
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.rank = dist.get_rank(self.process_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = None if padding_idx is None else normalize_padding_idx(padding_idx, num_embeddings)
        self.scale_grad_by_freq = scale_grad_by_freq
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, self.rank, self.world_size)
        rows = self.vocab_end - self.vocab_start
        self.weight = torch.nn.Parameter(torch.empty((rows, embedding_dim), device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.normal_(self.weight)
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            with torch.no_grad():
                self.weight[self.padding_idx - self.vocab_start].fill_(0)

    def _partial(self, indices):
        padding_idx = -1 if self.padding_idx is None else self.padding_idx
        w = self.weight
        if w.device.type == "cpu" and w.dtype in _KERNEL_DTYPES:
            return torch.ops.npukern.embedding_shard(
                w, indices, self.num_embeddings, self.vocab_start, padding_idx, self.scale_grad_by_freq
            )
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"VocabParallelEmbedding: indices must be int64 or int32, got {indices.dtype}")
        bad = (indices < 0) | (indices >= self.num_embeddings)
        if bool(bad.any()):
            pos = int(bad.reshape(-1).nonzero()[0])
            value = int(indices.reshape(-1)[pos])
            raise IndexError(f"VocabParallelEmbedding: indices[{pos}] = {value} is out of range for "
                             f"num_embeddings {self.num_embeddings} (flat position {pos}, value {value})")
        return _ShardLookupTorch.apply(w, indices, self.vocab_start, padding_idx, self.scale_grad_by_freq)

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        """The full lookup on every rank. Precondition (Megatron-LM's): every
        rank of the group passes the same indices. Each rank validates and
        looks up its shard first; then one small all-reduce tells every rank
        whether any rank failed (all raise the same exception type together,
        none is left blocked) and whether the indices differ across ranks (a
        checksum; ValueError on every rank), before the activation's own
        all-reduce."""
        error, partial, check = None, None, 0.0
        try:
            check = _indices_check(indices)
            partial = self._partial(indices)
        except Exception as e:  # noqa: BLE001  (reported on every rank below)
            error = e
        if self.world_size == 1:
            if error is not None:
                raise error
            return partial
        flags = torch.tensor([*_agree.encode(error), check, check * check], dtype=torch.float64)
        dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=self.process_group)
        _agree.raise_if_any(flags[: _agree.SLOTS], error, "VocabParallelEmbedding")
        total, squares = flags[_agree.SLOTS].item(), flags[_agree.SLOTS + 1].item()
        if self.world_size * squares != total * total:
            raise ValueError(
                "VocabParallelEmbedding: the ranks passed different indices; every rank of the group must "
                "pass the same indices (the vocab-parallel layout's precondition, as in Megatron-LM)"
            )
        return _SumOverGroup.apply(partial, self.process_group)

    @torch.no_grad()
    def load_full_weight_(self, full: torch.Tensor):
        """Copies this rank's rows of a full ``[num_embeddings, embedding_dim]`` weight."""
        if tuple(full.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"full weight has shape {tuple(full.shape)}, expected "
                             f"{(self.num_embeddings, self.embedding_dim)}")
        self.weight.copy_(full[self.vocab_start : self.vocab_end])
        return self

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """The full ``[num_embeddings, embedding_dim]`` weight, gathered on every rank."""
        most = -(-self.num_embeddings // self.world_size)
        padded = self.weight.new_zeros((most, self.embedding_dim))
        padded[: self.weight.shape[0]] = self.weight
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.process_group)
        rows = [vocab_range(self.num_embeddings, r, self.world_size) for r in range(self.world_size)]
        return torch.cat([p[: end - start] for p, (start, end) in zip(parts, rows)])

    def extra_repr(self):
        s = (f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.vocab_start}, {self.vocab_end}) "
             f"of rank {self.rank}/{self.world_size}")
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        return s
