"""SwiGLU and RoPE ops against PyTorch itself: values against float64, eager
numerics against eager PyTorch's bits, gradients against autograd of the
composite, torch_npu's npu_swiglu / npu_rotary_mul, opcheck and
torch.compile.

Tolerances and why:
- Fused (one rounding): within 1 ulp of the float64 value (16-bit dtypes) or
  4 float32 ulps (silu's exp is the library's own, <= 1.02 ulp).
- Eager RoPE: bit-identical to Hugging Face's apply_rotary_pos_emb and to
  its autograd gradients (the same products rounded, then the same sums).
- Eager SwiGLU: silu in float32 is npukern's exp, not PyTorch's (Sleef, with
  FMA): they differ by an f32 ulp or two now and then (float32 bar: 4 ulps),
  which moves a 16-bit rounding rarely (16-bit bar: at most 1 ulp anywhere,
  at most 1e-3 of the elements differ)."""

import pytest
import torch

import npukern_torch  # noqa: F401
from conftest import record
from npukern_torch import functional as F
from npukern_torch import hf
from npukern_torch import npu

ops = torch.ops.npukern
DT = [torch.float32, torch.float16, torch.bfloat16]
IDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
MANT = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def ulps(a, b, dtype):
    """max |a - b| in units of dtype's spacing at b (b's exponent)."""
    _, e = torch.frexp(b.double().abs())
    floor = {torch.float32: -126, torch.float16: -14, torch.bfloat16: -126}[dtype]
    spacing = torch.ldexp(torch.ones_like(e, dtype=torch.float64), torch.clamp(e - 1, min=floor) - MANT[dtype])
    d = (a.double() - b.double()).abs() / spacing
    return d.nan_to_num(0.0).max().item()


def gates(*shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    return (torch.rand(*shape, generator=g, dtype=torch.float64) * 16 - 8).to(dtype)


def rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", DT, ids=IDS.get)
def test_silu_mul_fused_and_eager(dtype):
    gate, up = gates(64, 300, dtype=dtype), rand(64, 300, dtype=dtype, seed=1)
    exact = (torch.nn.functional.silu(gate.double()) * up.double())
    fused = F.silu_mul(gate, up)
    bound = 4 if dtype == torch.float32 else 1
    assert ulps(fused, exact.to(dtype).double(), dtype) <= bound
    stock = torch.nn.functional.silu(gate) * up
    eager = F.silu_mul(gate, up, eager=True)
    worst, differ = ulps(eager, stock, dtype), (eager != stock).float().mean().item()
    record(f"silu_mul {IDS[dtype]} eager vs torch: ulps", worst)
    record(f"silu_mul {IDS[dtype]} eager vs torch: fraction differing", differ)
    if dtype == torch.float32:
        assert worst <= 4, worst  # the two exps' last bits, nothing rounds them away
    else:
        assert worst <= 1 and differ <= 1e-3, (worst, differ)


@pytest.mark.parametrize("dtype", DT, ids=IDS.get)
def test_swiglu_gradients_match_autograd(dtype):
    x = torch.cat([gates(8, 3, 40, dtype=dtype), rand(8, 3, 40, dtype=dtype, seed=2)], dim=1)
    x.requires_grad_(True)
    y = npu.npu_swiglu(x, dim=1)
    assert y.shape == (8, 3, 40)
    dy = rand(8, 3, 40, dtype=dtype, seed=3)
    (dx,) = torch.autograd.grad(y, x, dy)
    xd = x.detach().double().requires_grad_(True)
    a, b = xd.chunk(2, dim=1)
    (want,) = torch.autograd.grad(torch.nn.functional.silu(a) * b, xd, dy.double())
    scale = (dy.double().abs().repeat(1, 2, 1) * (1 + xd.detach().abs()) ** 2)
    err = ((dx.double() - want).abs() - 1e-5 * scale).clamp(min=0)
    bound = 4 if dtype == torch.float32 else 1
    assert ulps(want + err * torch.sign(dx.double() - want), want.to(dtype).double(), dtype) <= bound + 1
    # The two-tensor form gives the same bits as the split one.
    g, u = x.detach().chunk(2, dim=1)
    g, u = g.contiguous().requires_grad_(True), u.contiguous().requires_grad_(True)
    y2 = F.silu_mul(g, u)
    dg, du = torch.autograd.grad(y2, (g, u), dy)
    assert torch.equal(y2, y) and torch.equal(torch.cat([dg, du], dim=1), dx)


@pytest.mark.parametrize("dtype", DT, ids=IDS.get)
def test_rope_eager_is_hugging_faces_bits(dtype):
    import transformers.models.llama.modeling_llama as modeling

    original = modeling.apply_rotary_pos_emb  # never swapped: hf.patch is per model
    b, h, kh, s, d = 2, 4, 2, 9, 32
    # As the attention layers make them: [b, s, heads, d] memory, transposed views.
    q = rand(b, s, h, d, dtype=dtype).transpose(1, 2).requires_grad_(True)
    k = rand(b, s, kh, d, dtype=dtype, seed=1).transpose(1, 2).requires_grad_(True)
    t = torch.arange(s, dtype=torch.float32)[:, None] * torch.rand(d // 2)[None, :]
    emb = torch.cat([t, t], dim=-1)[None].expand(b, s, d)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    rq, rk = original(q, k, cos, sin)
    oq, ok = F.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(oq, rq) and torch.equal(ok, rk)
    gq, gk = rand(*rq.shape, dtype=dtype, seed=5), rand(*rk.shape, dtype=dtype, seed=6)
    want = torch.autograd.grad((rq, rk), (q, k), (gq, gk))
    got = torch.autograd.grad((oq, ok), (q, k), (gq, gk))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DT, ids=IDS.get)
def test_npu_rotary_mul_layout_and_table_gradients(dtype):
    x = rand(2, 7, 3, 64, dtype=dtype).requires_grad_(True)  # torch_npu's [b, s, n, d]
    r1 = rand(1, 7, 1, 64, dtype=torch.float32, seed=1).requires_grad_(True)
    r2 = rand(1, 7, 1, 64, dtype=torch.float32, seed=2).requires_grad_(True)
    y = npu.npu_rotary_mul(x, r1, r2)

    def composite(x, r1, r2):
        x1, x2 = x.chunk(2, -1)
        return x * r1 + torch.cat((-x2, x1), -1) * r2

    xd, r1d, r2d = (t.detach().double().requires_grad_(True) for t in (x, r1, r2))
    exact = composite(xd, r1d, r2d)
    xa = xd.detach()
    x1, x2 = xa.chunk(2, -1)
    scale = xa.abs() * r1d.detach().abs() + torch.cat((x2, x1), -1).abs() * r2d.detach().abs()
    assert ((y.double() - exact).abs() <= 2.0 ** -MANT[dtype] * exact.abs() + 2.0 ** -22 * scale + 1e-30).all()
    dy = rand(*y.shape, dtype=dtype, seed=4)
    got = torch.autograd.grad(y, (x, r1, r2), dy)
    want = torch.autograd.grad(exact, (xd, r1d, r2d), dy.double())
    for g, w in zip(got, want):
        tol = 2.0 ** -MANT[dtype] * 4 * w.abs().max()
        assert (g.double() - w).abs().max() <= tol, (g, w)


def test_bad_input_raises():
    with pytest.raises(ValueError, match="odd"):
        npu.npu_swiglu(torch.randn(3, 5))
    with pytest.raises(IndexError, match="dim"):
        npu.npu_swiglu(torch.randn(3, 4), dim=2)
    with pytest.raises(ValueError, match="cos"):
        npu.npu_rotary_mul(torch.randn(2, 8), torch.randn(3, 8), torch.randn(3, 8))
    with pytest.raises(ValueError, match="rotary_mode"):
        npu.npu_rotary_mul(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8), rotary_mode="interleave")


def _r(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


SAMPLES = [
    (ops.swiglu, (_r(4, 3, 8, grad=True), -1, False)),
    (ops.swiglu, (_r(6, 4, 5, dtype=torch.bfloat16, grad=True), 1, True)),
    (ops.silu_mul, (_r(5, 24, grad=True), _r(5, 24, grad=True), False)),
    (ops.swiglu_backward, (_r(4, 4), _r(4, 8), -1, False)),
    (ops.silu_mul_backward, (_r(4, 8), _r(4, 8), _r(4, 8), True)),
    (ops.rotary_mul, (_r(2, 3, 5, 8, grad=True), _r(1, 1, 5, 8), _r(1, 1, 5, 8), False, False)),
    (ops.rope_qk, (_r(2, 4, 5, 8, grad=True), _r(2, 2, 5, 8, grad=True), _r(2, 1, 5, 8), _r(2, 1, 5, 8),
                   True, False)),
]


@pytest.mark.parametrize("i", range(len(SAMPLES)))
def test_opcheck(i):
    op, args = SAMPLES[i]
    torch.library.opcheck(op, args)


@pytest.mark.torch_only
def test_compile_fullgraph():
    def block(x, w_gate, w_up, q, k, cos, sin):
        h = F.silu_mul(x @ w_gate, x @ w_up)
        q2, k2 = F.apply_rotary_pos_emb(q, k, cos, sin)
        return h.sum() + q2.sum() + k2.sum()

    args = (torch.randn(4, 8), torch.randn(8, 16), torch.randn(8, 16), torch.randn(1, 2, 4, 8),
            torch.randn(1, 2, 4, 8), torch.randn(1, 4, 8), torch.randn(1, 4, 8))
    compiled = torch.compile(block, fullgraph=True)
    torch.testing.assert_close(compiled(*args), block(*args))


def test_apply_rotary_pos_emb_promotes_mixed_dtypes_as_hugging_face():
    import transformers.models.llama.modeling_llama as modeling

    # float32 tables beside bf16 q/k: the composite's type promotion (float32 out).
    g = torch.Generator().manual_seed(9)
    q = torch.randn(1, 4, 5, 8, generator=g).bfloat16()
    k = torch.randn(1, 2, 5, 8, generator=g).bfloat16()
    cos, sin = torch.randn(1, 5, 8, generator=g), torch.randn(1, 5, 8, generator=g)
    want = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    got = F.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(got, want))
