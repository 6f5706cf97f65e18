"""The norm numerics a model family uses, as (offset, cast_before_gamma).

- ``"torch"``: ``y = round(x * rstd * (offset + gamma))``, fp32 inside, one
  rounding (torch.nn.RMSNorm, torch_npu's npu_rms_norm); offset 0.
- ``"llama"``: ``y = round(x * rstd) * (offset + gamma)`` with torch's type
  promotion: the normalized x is rounded to x's dtype first (Hugging Face
  Llama / Mistral / Qwen2 / Qwen3, Meta's ``_norm(x.float()).type_as(x) *
  weight``); a float32 weight with a bfloat16 x gives a float32 y; offset 0.
- ``"gemma"``: ``y = round(x * rstd * (1 + gamma))`` in fp32, one rounding
  (Gemma, Gemma2, Gemma3's zero-centred weights); offset 1.

``offset`` overrides the mode's offset for any other ``(offset + w)``."""

import torch

CASTINGS = ("torch", "llama", "gemma")


def resolve(casting, offset):
    """``(offset, cast_before_gamma)`` of a casting mode (ValueError for an unknown one)."""
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {CASTINGS}, got {casting!r}")
    if offset is None:
        offset = 1.0 if casting == "gemma" else 0.0
    return float(offset), casting == "llama"


def needs_promotion(x, gamma, cast_before_gamma):
    """True when the llama mode's product promotes past x's dtype (a float32
    weight with a 16-bit x): the kernel writes y in x's dtype, so that case is
    composed from the kernel's normalized x and a torch multiply."""
    return cast_before_gamma and torch.promote_types(x.dtype, gamma.dtype) != x.dtype
