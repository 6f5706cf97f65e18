"""Functional forms of the ops, shaped like torch_npu's (npu_rms_norm,
npu_add_rms_norm): they return rstd (and x_sum) besides y. Each is
differentiable in x (x1, x2) and gamma. ``casting`` and ``offset`` choose a
model family's numerics (see ``_casting.py``)."""

import torch

from . import _casting

ops = torch.ops.npukern


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, *, casting: str = "torch", offset=None):
    """``(y, rstd)``: ``y = x / sqrt(mean(x**2) + eps) * (offset + gamma)`` over
    the trailing dims gamma covers, rounded as `casting` says ("torch": once;
    "llama": the normalized x to x's dtype first, then the product with
    torch's type promotion; "gemma": once, offset 1). rstd (float32) has x's
    shape with those dims set to 1. gamma is x's dtype or float32 (or, with
    "llama", any dtype torch promotes with x)."""
    offset, cast_before_gamma = _casting.resolve(casting, offset)
    if _casting.needs_promotion(x, gamma, cast_before_gamma):
        normalized, rstd = ops.rms_norm(x, torch.ones_like(gamma, dtype=x.dtype), eps)
        return normalized * (gamma + offset if offset else gamma), rstd
    return ops.rms_norm(x, gamma, eps, offset, cast_before_gamma)


def add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, *,
                 casting: str = "torch", offset=None):
    """``(y, rstd, x_sum)``: ``x_sum = x1 + x2`` (rounded to x's dtype) and the
    RMSNorm of x_sum in `casting`'s numerics, in one pass (the residual add
    before a LLaMA block's norm)."""
    offset, cast_before_gamma = _casting.resolve(casting, offset)
    if _casting.needs_promotion(x1, gamma, cast_before_gamma):
        normalized, rstd, x_sum = ops.add_rms_norm(x1, x2, torch.ones_like(gamma, dtype=x1.dtype), eps)
        return normalized * (gamma + offset if offset else gamma), rstd, x_sum
    return ops.add_rms_norm(x1, x2, gamma, eps, offset, cast_before_gamma)


def embedding(indices: torch.Tensor, weight: torch.Tensor, padding_idx=None, scale_grad_by_freq: bool = False):
    """``torch.nn.functional.embedding`` (without max_norm and sparse) whose
    weight gradient comes from npukern's EmbeddingDenseGrad. A negative
    padding_idx counts from the end, as in torch."""
    return ops.embedding(weight, indices, normalize_padding_idx(padding_idx, weight.shape[0]), scale_grad_by_freq)


def normalize_padding_idx(padding_idx, num_embeddings):
    """torch.nn.functional.embedding's rule: None -> -1 (none), negative ->
    counted from the end; out of [-num_embeddings, num_embeddings) is an error."""
    if padding_idx is None:
        return -1
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"padding_idx {padding_idx} must be within num_embeddings {num_embeddings}")
    return padding_idx + num_embeddings if padding_idx < 0 else padding_idx
