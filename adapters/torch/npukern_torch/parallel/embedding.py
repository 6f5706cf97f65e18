"""VocabParallelEmbedding: the embedding table split by vocabulary range
over the ranks of a process group."""

import torch
import torch.distributed as dist

from ..functional import normalize_padding_idx


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

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        padding_idx = -1 if self.padding_idx is None else self.padding_idx
        partial = torch.ops.npukern.embedding_shard(
            self.weight, indices, self.num_embeddings, self.vocab_start, padding_idx, self.scale_grad_by_freq
        )
        if self.world_size == 1:
            return partial
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
