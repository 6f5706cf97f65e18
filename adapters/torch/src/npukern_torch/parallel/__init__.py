"""npukern_torch.parallel: vocab-parallel embedding and one global gradient
norm on torch.distributed (any backend: the kernels run where the tensors
are; npukern never moves data between ranks).

- :class:`VocabParallelEmbedding`: rank r owns rows
  ``[vocab_start, vocab_end)`` of the table (Megatron-LM's layout); its
  weight gradient is npukern's EmbeddingDenseGrad of that vocabulary range,
  bit-identical to the same rows of the single-process gradient.
- :func:`clip_grad_norm_`: the total L2 norm over sharded and replicated
  gradients (sums of squares from npukern's grad_stats, all-reduced), then
  every gradient scaled by the one coefficient.
- :func:`vocab_parallel_cross_entropy`: ``F.cross_entropy`` of logits split
  by vocabulary in the same layout (Megatron-LM's), each shard's gradient
  computed locally; :func:`vocab_parallel_linear_cross_entropy` fuses the LM
  head with it (chunks of tokens, no ``[N, V_local]`` logits). The per-row
  partials are all-gathered and combined in rank order, so the loss is the
  same bits on every rank and every run.
"""

from .clip import clip_grad_norm_
from .cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy
from .embedding import VocabParallelEmbedding, vocab_range

__all__ = ["VocabParallelEmbedding", "clip_grad_norm_", "vocab_parallel_cross_entropy",
           "vocab_parallel_linear_cross_entropy", "vocab_range"]
