"""npukern_torch: PyTorch adapter for npukern's kernels (a client of its C ABI).

Importing it registers the ``torch.ops.npukern`` ops with CPU kernels, fake
implementations (torch.compile) and autograd formulas:

- ``rms_norm(x, gamma, epsilon=1e-6, gamma_offset=0.0, cast_before_gamma=False) -> (y, rstd)``
- ``rms_norm_backward(dy, x, gamma, rstd, gamma_offset=0.0) -> (dx, dgamma)``
- ``add_rms_norm(x1, x2, gamma, epsilon=1e-6, gamma_offset=0.0, cast_before_gamma=False) -> (y, rstd, x_sum)``
- ``add_rms_norm_(x1, x2, gamma, epsilon=1e-6, gamma_offset=0.0, cast_before_gamma=False) -> (y, rstd)``
  (x1 + x2 written over x1: IPEX's ``add_rms_norm`` with ``add_back=True``)
- ``add_rms_norm_backward(dy, x_sum, gamma, rstd, dx_sum, gamma_offset=0.0) -> (dx, dgamma)``
- ``embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False)``
  and ``embedding_shard(...)`` (lookups whose backward is npukern's)
- ``embedding_dense_backward(grad, indices, num_weights, padding_idx, scale_grad_by_freq)``
  and ``embedding_dense_backward_shard(...)`` (one vocab range)
- ``grad_stats(grads) -> [sum_sq, nan, inf, min, max, absmax]`` (float64)
- ``clip_grad_norm_(grads, max_norm, error_if_nonfinite=False) -> total_norm`` (in place)
- ``adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, masters, lr, beta1, beta2,
  eps, weight_decay, step, flags, max_grad_norm, grad_scale, found_inf, clip_coef, exp_avg_scales,
  exp_avg_sq_scales, max_exp_avg_sq_scales, split_masters=0, rounding=0, seed=0, keys=[],
  quantized_moments=0, q8_rows=[]) -> [grad_norm, stepped]``
  (one AdamW / Adam step in place; grad_norm is 0 without CLIP; :mod:`npukern_torch.optim` wraps it)
- ``cross_entropy(logits, target, weight, reduction, ignore_index, label_smoothing,
  lse_square_scale, softcap) -> (loss, lse)``, its backward, and ``cross_entropy_fused_``
  (loss and dlogits in place: the fused linear cross-entropy's step)
- ``matmul(a, b, trans_a, trans_b, out_dtype, math)``, ``matmul_accumulate_``, ``linear``
- ``attention(q, k, v, is_causal=False, scale=None) -> (out, softmax_max, softmax_sum)`` and
  ``attention_backward(dout, q, k, v, out, softmax_max, softmax_sum, is_causal, scale) -> (dq, dk, dv)``
  (SDPA without mask or dropout, grouped-query heads; ``functional.scaled_dot_product_attention`` wraps it)

and exports drop-in modules (:class:`RMSNorm`, :class:`AddRMSNorm`,
:class:`Embedding`; ``casting="torch" | "llama" | "gemma"`` and ``offset``
choose a model family's numerics), :func:`clip_grad_norm_`, and the
functional forms, :func:`cross_entropy` (F.cross_entropy's signature) and
:func:`linear_cross_entropy` (the LM head fused with the loss). ``npukern_torch.parallel`` has the torch.distributed
pieces, ``npukern_torch.hf`` patches Hugging Face models
(``patch(model)``), and ``npukern_torch.npu`` offers torch_npu's
``npu_rms_norm`` / ``npu_add_rms_norm``.
"""

import torch  # noqa: F401  (first: loads libtorch / libc10, which the extension _C links against)

from . import _C  # noqa: F401  (loads the library: registers torch.ops.npukern)
from . import _autograd, _meta  # noqa: F401  (registrations)
from . import optim  # noqa: F401  (npukern_torch.optim.AdamW / Adam)
from .clip import clip_grad_norm_
from .functional import add_rms_norm, add_rms_norm_, embedding, rms_norm
from .loss import cross_entropy, linear_cross_entropy
from .modules import AddRMSNorm, Embedding, RMSNorm

__version__ = "0.1.0"
library_version = _C.version()
detected_isa = _C.detected_isa()

__all__ = [
    "AddRMSNorm",
    "Embedding",
    "RMSNorm",
    "add_rms_norm",
    "add_rms_norm_",
    "clip_grad_norm_",
    "cross_entropy",
    "detected_isa",
    "embedding",
    "library_version",
    "linear_cross_entropy",
    "rms_norm",
]
