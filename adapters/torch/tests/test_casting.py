"""The norm numerics of each model family (casting="torch" | "llama" |
"gemma", and any offset) in the ops, functional forms and modules.

Forward: bit-identical to the mode's composite written in torch ops from the
kernel's own rstd ("torch" and "gemma": (x * rstd) * (offset + gamma) in
float32, one rounding; "llama": round(x * rstd) to x's dtype, then times
gamma with torch's type promotion) -- the only freedom left is rstd, whose
float32 row sum runs in npukern's fixed order (rstd itself is checked
against float64 to 1e-6). Backward: the gradient of that composite, against
float64 autograd of it, with norm_check's bars (dx: 1 ulp + the f32
reduction term; dgamma: 1e-5 of sum |dy xh|)."""

import pytest
import torch

import npukern_torch
from conftest import DTYPES, rand, record, ulp
from norm_check import f32

ops = torch.ops.npukern
MODES = [("torch", None), ("llama", None), ("gemma", None), ("torch", 0.5), ("llama", -0.25)]
MODE_IDS = ["torch", "llama", "gemma", "torch+0.5", "llama-0.25"]


def _offset(casting, offset):
    return (1.0 if casting == "gemma" else 0.0) if offset is None else offset


def composite(x, gamma, rstd, casting, offset):
    """The mode's forward in torch ops, from the kernel's rstd."""
    normalized = x.float() * rstd
    g = gamma.float() + offset  # (offset + gamma) in float32, as HF Gemma's 1.0 + weight.float()
    if casting == "llama":
        out = torch.promote_types(x.dtype, gamma.dtype)
        return (normalized.to(x.dtype).float() * g).to(out)
    return (normalized * g).to(x.dtype)


def reference64(x, gamma, eps, dy, offset):
    """float64 autograd of x * rsqrt(mean(x^2) + eps) * (offset + gamma) (the
    composite of every mode, its roundings being the identity to autograd)."""
    x64 = x.detach().double().requires_grad_()
    g64 = gamma.detach().double().requires_grad_()
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(x64.pow(2).mean(dims, keepdim=True) + f32(eps))
    y = x64 * rstd * (g64 + offset)
    dx, dg = torch.autograd.grad(y, (x64, g64), dy.double())
    return rstd.detach(), dx, dg


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("gamma_f32", [False, True], ids=["gamma x-dtype", "gamma f32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_mode_forward_and_backward(mode, gamma_f32, dtype, fused, gen):
    casting, offset = mode
    off = _offset(casting, offset)
    x = rand((6, 3, 97), dtype, -4, 4, gen=gen)
    x2 = rand((6, 3, 97), dtype, -4, 4, gen=gen)
    gamma = rand((97,), torch.float32 if gamma_f32 else dtype, -1.5, 1.5, gen=gen)
    dy_dtype = torch.promote_types(dtype, gamma.dtype) if casting == "llama" else dtype
    dy = rand((6, 3, 97), dy_dtype, -2, 2, gen=gen)
    eps = 1e-5
    xs, gs = x.clone().requires_grad_(), gamma.clone().requires_grad_()
    if fused:
        y, rstd, x_sum = npukern_torch.add_rms_norm(xs, x2, gs, eps, casting=casting, offset=offset)
        assert torch.equal(x_sum, x + x2)
        base = x + x2
    else:
        y, rstd = npukern_torch.rms_norm(xs, gs, eps, casting=casting, offset=offset)
        base = x
    want = composite(base, gamma, rstd, casting, off)
    assert y.dtype == want.dtype and torch.equal(y, want), (y - want).abs().max()
    r64, dx64, dg64 = reference64(base, gamma, eps, dy, off)
    assert ((rstd.double() - r64).abs() <= 1e-6 * r64.abs()).all()
    y.backward(dy)
    label = f"casting {casting}{'' if offset is None else offset}"
    promoted = dy_dtype != dtype
    # dx's bar: 1 ulp + the f32 reduction term, with the effective gamma
    # (offset + gamma). When llama's product promoted (an f32 weight with a
    # 16-bit x), autograd rounds the gradient reaching the kernel to x's dtype
    # once (as torch's autograd of the composite does): that adds x's unit
    # roundoff to the reduction term.
    g = dy.double() * (gamma.double() + off)
    xh = base.double() * r64
    dims = (-1,)
    c_abs = (g * xh).abs().mean(dims, keepdim=True)
    unit = {torch.float32: 0.0, torch.float16: 2**-11, torch.bfloat16: 2**-8}[dtype] if promoted else 0.0
    bar = ulp(dx64, dtype) + (1e-5 + unit) * r64 * (g.abs() + xh.abs() * c_abs)
    dx_score = ((xs.grad.double() - dx64).abs() / bar).max().item()
    record(f"dx score ({dtype}) {label}{' promoted' if promoted else ''}", dx_score)
    assert xs.grad.dtype == dtype and dx_score <= 1.0, dx_score
    # dgamma: 1e-5 of sum |dy xh| (the f32 column sums), plus gamma's own
    # rounding; promoted, the product's gradient sees x * rstd rounded to x's
    # dtype (unit roundoff of it on every term).
    abs_sum = (dy.double() * xh).abs().sum((0, 1))
    rounding = 0.0 if gamma.dtype == torch.float32 else {torch.float16: 2**-11, torch.bfloat16: 2**-8}[gamma.dtype]
    assert gs.grad.dtype == gamma.dtype
    dg_score = ((gs.grad.double() - dg64).abs() / ((1e-5 + unit) * abs_sum + rounding * dg64.abs() + 1e-300)).max().item()
    record(f"dgamma score {label}", dg_score)
    assert dg_score <= 1.0, dg_score


def test_llama_f32_weight_with_bf16_x_gives_f32(gen):
    """Meta's / Hugging Face's `_norm(x.float()).type_as(x) * weight` with an
    f32 weight: the product promotes to float32."""
    x = rand((4, 64), torch.bfloat16, -3, 3, gen=gen)
    m = npukern_torch.RMSNorm(64, eps=1e-6, casting="llama")
    with torch.no_grad():
        m.weight.copy_(rand((64,), torch.float32, 0.5, 1.5, gen=gen))
    y = m(x)
    _, rstd = npukern_torch.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    assert y.dtype == torch.float32 and torch.equal(y, m.weight * (x.float() * rstd).to(torch.bfloat16))


def test_modules_fall_back_with_the_same_numerics(gen):
    """float64 (not a kernel dtype) runs the mode in torch ops."""
    x = rand((4, 32), torch.float32, -3, 3, gen=gen).double()
    for casting in ("torch", "llama", "gemma"):
        m = npukern_torch.RMSNorm(32, eps=1e-6, casting=casting).double()
        with torch.no_grad():
            m.weight.copy_(torch.linspace(-1, 1, 32))
        off = 1.0 if casting == "gemma" else 0.0
        want = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * (m.weight + off)
        torch.testing.assert_close(m(x), want, rtol=1e-12, atol=1e-12)


def test_bad_casting_is_refused():
    with pytest.raises(ValueError, match="casting must be one of"):
        npukern_torch.RMSNorm(8, casting="mistral")
    with pytest.raises(ValueError, match="gamma_offset"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(8), 1e-6, 0.1, False)  # 0.1 is not a float32 value


def test_opcheck_with_the_new_arguments(gen):
    x = rand((3, 16), torch.bfloat16, -2, 2, gen=gen)
    gamma = rand((16,), torch.bfloat16, -1, 1, gen=gen).requires_grad_()
    xr = x.clone().requires_grad_()
    torch.library.opcheck(ops.rms_norm, (xr, gamma, 1e-6, 1.0, True))
    torch.library.opcheck(ops.add_rms_norm, (xr, x, gamma, 1e-6, 0.5, False))
    _, rstd = ops.rms_norm(x, gamma.detach(), 1e-6, 1.0, False)
    torch.library.opcheck(ops.rms_norm_backward, (x, x, gamma.detach(), rstd, 1.0))
