"""What the README and docs/huggingface.md claim about a patched model's bits
against the stock one, at several sizes (2 layers, head_dim 64, the same
builder as adapters/torch/hf_bits.py):

- with the norms left stock (``rms_norm=False``) the bf16 logits are the
  stock bits in every family: embedding, SwiGLU, RoPE and the loss route's
  logits are exact (float32 differs in the last bits: see the docs);
- with the norms patched, the only difference is the norms' float32 rstd:
  the stock model whose RMSNorm forward takes its rstd from npukern's kernel
  (and keeps its own formula otherwise) gives the patched logits bit for
  bit. npukern's rstd is an IEEE 1/sqrt of its fixed-order sum of squares;
  stock's is torch.rsqrt of torch's own reduction, and both the order and
  torch's rsqrt (not IEEE 1/sqrt on the PyPI CPU build) move its last bit on
  some rows, which flips rare bf16 norm outputs by one step."""

import sys
import types
from pathlib import Path

import pytest
import torch

import npukern_torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_bits  # noqa: E402  (adapters/torch/hf_bits.py)

FAMILIES = tuple(hf_bits.F)
SIZES = (256, 512)


def kernel_rstd_forward(module, x):
    """The family's stock RMSNorm forward with rstd from npukern's kernel."""
    rstd = npukern_torch.rms_norm(x, torch.ones(x.shape[-1], dtype=x.dtype), module.eps
                                  if hasattr(module, "eps") else module.variance_epsilon)[1]
    h = x.float() * rstd
    if type(module).__name__.startswith("Gemma"):
        return (h * (1.0 + module.weight.float())).type_as(x)
    return module.weight * h.to(x.dtype)


def with_kernel_rstd(model):
    for _, m in model.named_modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(kernel_rstd_forward, m)
    return model


@pytest.mark.parametrize("hidden", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_stock_bits_but_the_norms(family, hidden):
    stock, patched = hf_bits.logits_pair(family, torch.bfloat16, hidden, seed=0, norms=False, tokens=(2, 32))
    assert torch.equal(stock, patched)


@pytest.mark.parametrize("hidden", SIZES)
@pytest.mark.parametrize("family", FAMILIES)
def test_norms_differ_only_by_rstd(family, hidden, monkeypatch):
    stock, patched = hf_bits.logits_pair(family, torch.bfloat16, hidden, seed=0, tokens=(2, 32))
    # The twin: the stock model (a fresh build, same seed) with the kernel's rstd.
    monkeypatch.setattr(hf_bits.hf, "patch", lambda model, **kw: with_kernel_rstd(model))
    stock_again, stock_with_kernel_rstd = hf_bits.logits_pair(family, torch.bfloat16, hidden, seed=0, tokens=(2, 32))
    assert torch.equal(stock, stock_again)
    assert torch.equal(patched, stock_with_kernel_rstd)
