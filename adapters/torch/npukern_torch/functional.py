"""Functional forms of the ops, shaped like torch_npu's (npu_rms_norm,
npu_add_rms_norm): they return rstd (and x_sum) besides y. Each is
differentiable in x (x1, x2) and gamma."""

import torch

ops = torch.ops.npukern


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6):
    """``(y, rstd)``: ``y = x / sqrt(mean(x**2) + eps) * gamma`` over the trailing
    dims gamma covers; rstd (float32) has x's shape with those dims set to 1.
    gamma is x's dtype or float32."""
    return ops.rms_norm(x, gamma, eps)


def add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6):
    """``(y, rstd, x_sum)``: ``x_sum = x1 + x2`` (rounded to x's dtype) and the
    RMSNorm of x_sum, in one pass (the residual add before a LLaMA block's norm)."""
    return ops.add_rms_norm(x1, x2, gamma, eps)


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
