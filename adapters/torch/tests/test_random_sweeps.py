"""Seeded random sweeps of the two compute ops through PyTorch, each call
against float64: shapes, strides, transposes, grouped heads and options
drawn at random (cases no hand-written test picked), forward and every
gradient. The kernels are the same bits on every ISA and thread count, so
a seed gives the same errors everywhere.

Errors are relative to the output's natural scale: its largest |value|,
floored at 1e-3 of the incoming gradient's (a row that sees a single key
has dq and dk of exactly zero in float64 and rounding noise here)."""

import random

import pytest
import torch

from npukern_torch import functional as F

# Worst seen over 400 / 600 cases (2026-12-06), with about 1.3-2x margin;
# torch's own CPU attention was up to 2.2e-2 (bf16), 1.2e-2 (f16) and
# 8.3e-3 (f32) on the same cases.
ATTENTION_TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-2, torch.float16: 5e-3}
MATMUL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _err(got, want, floor):
    got, want = got.double(), want.detach()
    assert got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    if want.numel() == 0:
        return 0.0
    nat = max(want.abs().max().item(), floor)
    return (got - want).abs().max().item() / nat


def _view(shape, dt, layout, rng):
    """A tensor of `shape` (rank 4, [B, H, S, D]) stored as `layout`."""
    b, h, s, d = shape
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if layout == "bsnd":
        return torch.randn(b, s, h, d, generator=gen).to(dt).transpose(1, 2)
    if layout == "strided":
        return torch.randn(b, h, s, d + 5, generator=gen).to(dt)[..., 2:d + 2]
    return torch.randn(b, h, s, d, generator=gen).to(dt)


@pytest.mark.parametrize("seed", range(60))
def test_attention_random_cases_against_float64(seed):
    rng = random.Random(seed)
    b, hkv, grp = rng.choice([1, 2]), rng.choice([1, 2, 3]), rng.choice([1, 2, 4])
    hq = hkv * grp
    sq = rng.choice([1, 2, 5, 16, 17, 63, 84, 85, 100, 130])
    skv = rng.choice([sq, sq, 1, 7, 33, 90, 131])
    d = rng.choice([1, 3, 8, 16, 17, 31, 64, 80, 96, 128])
    causal = rng.random() < 0.5
    scale = rng.choice([None, None, 0.05, 1.7])
    dt = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    layout = rng.choice(["bnsd", "bsnd", "strided"])
    q, k, v = _view((b, hq, sq, d), dt, layout, rng), _view((b, hkv, skv, d), dt, layout, rng), \
        _view((b, hkv, skv, d), dt, layout, rng)
    dout = _view((b, hq, sq, d), dt, "bnsd", rng)
    gqa = hq != hkv
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=gqa)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, scale=scale,
                                                           enable_gqa=gqa)
    ref.backward(dout.double())
    floor = 1e-3 * dout.double().abs().max().item()
    case = dict(b=b, hq=hq, hkv=hkv, sq=sq, skv=skv, d=d, causal=causal, scale=scale, dtype=dt, layout=layout)
    for name, got, want in (("out", out, ref), ("dq", qs.grad, q64.grad), ("dk", ks.grad, k64.grad),
                            ("dv", vs.grad, v64.grad)):
        assert _err(got, want, floor) <= ATTENTION_TOL[dt], (name, case)


def _operand(shape, dt, mode, rng):
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if mode == "t":
        return torch.randn(*reversed(shape), generator=gen).to(dt).t()
    if mode == "slice":
        return torch.randn(*[s + 3 for s in shape], generator=gen).to(dt)[tuple(slice(1, 1 + s) for s in shape)]
    return torch.randn(*shape, generator=gen).to(dt)


@pytest.mark.parametrize("seed", range(80))
def test_matmul_and_linear_random_cases_against_float64(seed):
    rng = random.Random(1000 + seed)
    dt = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    m, k, n = rng.choice([1, 2, 7, 16, 31, 84, 97]), rng.choice([1, 3, 16, 17, 64, 100]), \
        rng.choice([1, 5, 16, 33, 48])
    math = rng.choice(["chain", "bf16_dot"]) if dt == torch.bfloat16 else "chain"
    gen = torch.Generator().manual_seed(seed)
    if rng.random() < 0.5:
        ta, tb = rng.random() < 0.5, rng.random() < 0.5
        a = _operand((k, m) if ta else (m, k), dt, rng.choice(["contig", "t", "slice"]), rng)
        b = _operand((n, k) if tb else (k, n), dt, rng.choice(["contig", "t", "slice"]), rng)
        out_dtype = rng.choice([None, torch.float32])
        aa, bb = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        y = F.matmul(aa, bb, trans_a=ta, trans_b=tb, out_dtype=out_dtype, math=math)
        a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
        ref = (a64.t() if ta else a64) @ (b64.t() if tb else b64)
        dy = torch.randn(m, n, generator=gen).to(y.dtype)
        y.backward(dy)
        ref.backward(dy.double())
        pairs = [("y", y, ref), ("da", aa.grad, a64.grad), ("db", bb.grad, b64.grad)]
    else:
        x = _operand((m, k), dt, rng.choice(["contig", "slice"]), rng)
        if rng.random() < 0.3:
            x = torch.stack([x, x.flip(0)])  # a 3-D input
        w = _operand((n, k), dt, rng.choice(["contig", "t", "slice"]), rng)
        bias = torch.randn(n, generator=gen).to(dt) if rng.random() < 0.5 else None
        xx, ww = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        bb = None if bias is None else bias.detach().clone().requires_grad_()
        y = F.linear(xx, ww, bb, math=math)
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        b64 = None if bias is None else bias.double().requires_grad_()
        ref = torch.nn.functional.linear(x64, w64, b64)
        dy = torch.randn(*y.shape, generator=gen).to(dt)
        y.backward(dy)
        ref.backward(dy.double())
        pairs = [("y", y, ref), ("dx", xx.grad, x64.grad), ("dw", ww.grad, w64.grad)]
        if bias is not None:
            pairs.append(("db", bb.grad, b64.grad))
    for name, got, want in pairs:
        assert got is not None, name
        tol = MATMUL_TOL[torch.float32 if got.dtype == torch.float32 else dt]
        assert _err(got, want, 1e-6) <= tol, (name, dt, m, k, n, math)
