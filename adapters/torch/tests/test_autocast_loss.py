"""linear_cross_entropy (and hf.patch's loss route) under CPU autocast: the
chunks' logits as autocast computes them (bf16 / f16 matmuls of the cast
input and weight), never the [N, V] composite; the loss and gradients
against stock autocast's (``F.linear`` then ``F.cross_entropy`` of the
float32 logits).

Bounds (stated): the loss within 1e-6 relative (both reduce the same
16-bit logits in float32); the input and weight gradients within 2^-8 of
their largest entry (one 16-bit rounding each side, in different places:
stock rounds the [N, V] logits' gradient to bf16, the kernel rounds the
accumulated gradient once)."""

import pytest
import torch

import npukern_torch
from hf_models import build, tokens, twin
from npukern_torch import hf, loss as _loss


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_under_autocast(dt, bias, monkeypatch):
    torch.manual_seed(0)
    n, h, v = 300, 64, 1000
    x = torch.randn(n, h, requires_grad=True)
    w = (torch.randn(v, h) * 0.05).requires_grad_()
    b = (torch.randn(v) * 0.1).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,))
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    b2 = b.detach().clone().requires_grad_() if bias else None
    composite = []
    real = _loss._composite
    monkeypatch.setattr(_loss, "_composite", lambda *a, **k: composite.append(1) or real(*a, **k))
    with torch.autocast("cpu", dt):
        got = npukern_torch.linear_cross_entropy(x, w, t, b)
        want = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x2, w2, b2).float(), t)
    assert not composite, "the [N, V] composite ran"
    assert got.dtype == torch.float32
    assert abs(got.item() - want.item()) <= 1e-6 * abs(want.item())
    got.backward()
    want.backward()
    for a, c in [(x, x2), (w, w2)] + ([(b, b2)] if bias else []):
        assert a.grad.dtype == c.grad.dtype == torch.float32
        assert (a.grad - c.grad).abs().max() <= 2**-8 * c.grad.abs().max()


def test_patched_llama_loss_route_engages_under_autocast(monkeypatch):
    stock = build("llama", seed=3)
    patched = twin(stock)
    assert hf.patch(patched)["loss"] == 1
    composite = []
    real = _loss._composite
    monkeypatch.setattr(_loss, "_composite", lambda *a, **k: composite.append(1) or real(*a, **k))
    x = tokens(seed=4)
    with torch.autocast("cpu", torch.bfloat16):
        a = stock(x, labels=x).loss
        b = patched(x, labels=x).loss
    assert not composite
    assert abs(a.item() - b.item()) <= 1e-5 * abs(a.item())
    a.backward()
    b.backward()
    for (name, p), q in zip(stock.named_parameters(), patched.parameters()):
        assert (p.grad - q.grad).abs().max() <= 2**-7 * p.grad.abs().max() + 1e-7, name
