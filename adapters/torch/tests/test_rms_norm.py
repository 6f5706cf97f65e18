"""RMSNorm / AddRmsNorm ops, forward and backward, against torch's composite
in float64 (norm_check.py states the bars)."""

import pytest
import torch

from conftest import DTYPES, HALF, rand, record, ulps
from norm_check import check_all, check_backward, check_forward, reference

ops = torch.ops.npukern

# The seed's four shapes: x [a, b, h], gamma [h], bfloat16.
SEED_SHAPES = [(1024, 1, 12288), (512, 4, 4096), (4, 2048, 5120), (2, 2048, 4096)]

# (x shape, number of trailing dims gamma covers): one row, one column, odd
# lengths, rows longer than a 192 KiB UB tile (split-D), multi-dim gamma.
SHAPES = [
    ((1, 1), 1),
    ((1, 17), 1),
    ((3, 1), 1),
    ((7, 33), 1),
    ((5, 4097), 1),
    ((2, 70001), 1),
    ((64, 130), 1),
    ((2, 3, 4, 8), 2),
    ((3, 5, 7), 2),
    ((6, 2, 9), 3),
]


@pytest.mark.parametrize("shape", SEED_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_seed_shapes_bf16(shape, gen):
    h = shape[-1]
    x = rand(shape, torch.bfloat16, gen=gen)
    gamma = rand((h,), torch.bfloat16, 0.5, 1.5, gen=gen)
    dy = rand(shape, torch.bfloat16, -0.1, 0.1, gen=gen)
    check_all(x, gamma, 1e-6, dy, label="seed")


# (x dtype, gamma dtype): gamma is x's dtype, or float32 with a half x.
DTYPE_PAIRS = [(d, d) for d in DTYPES] + [(d, torch.float32) for d in HALF]


@pytest.mark.parametrize("dtype,gdt", DTYPE_PAIRS, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape,gdims", SHAPES, ids=lambda v: str(v))
def test_shapes(shape, gdims, dtype, gdt, gen):
    x = rand(shape, dtype, gen=gen)
    gamma = rand(shape[len(shape) - gdims :], gdt, -1.5, 1.5, gen=gen)
    dy = rand(shape, dtype, -1.0, 1.0, gen=gen)
    check_all(x, gamma, 1e-6, dy, label="shapes")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_shapes(dtype, gen):
    for _ in range(6):
        ndim = int(torch.randint(1, 5, (), generator=gen))
        shape = tuple(int(v) for v in torch.randint(1, 40, (ndim,), generator=gen))
        gdims = int(torch.randint(1, ndim + 1, (), generator=gen))
        x = rand(shape, dtype, -3.0, 3.0, gen=gen)
        gamma = rand(shape[ndim - gdims :], dtype, -2.0, 2.0, gen=gen)
        dy = rand(shape, dtype, gen=gen)
        check_all(x, gamma, 1e-5, dy, label="random")


MAGNITUDES = {
    torch.float32: (1e15, 1e-15),
    torch.bfloat16: (1e15, 1e-15),
    torch.float16: (3e4, 1e-4),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_huge_and_tiny(dtype, gen):
    for mag in MAGNITUDES[dtype]:
        x = rand((4, 300), dtype, -mag, mag, gen=gen)
        gamma = rand((300,), dtype, 0.5, 1.5, gen=gen)
        dy = rand((4, 300), dtype, gen=gen)
        check_all(x, gamma, 0.0, dy, label="magnitudes")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nan_and_inf_propagate(dtype, gen):
    x = rand((5, 40), dtype, gen=gen)
    x[1, 3] = float("nan")
    x[3, 7] = float("inf")
    gamma = rand((40,), dtype, gen=gen)
    dy = rand((5, 40), dtype, gen=gen)
    y, rstd = ops.rms_norm(x, gamma, 1e-6)
    y64, r64, _, _ = reference(x, gamma, 1e-6, dy)
    check_forward(y, rstd, x, gamma, y64, r64, "nan/inf")
    assert rstd[1].isnan().all() and rstd[3].item() == 0.0
    # The other rows do not see the bad ones: bit-identical to running alone.
    clean = [0, 2, 4]
    y_alone, rstd_alone = ops.rms_norm(x[clean], gamma, 1e-6)
    assert torch.equal(y[clean], y_alone) and torch.equal(rstd[clean], rstd_alone)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_independent_of_batch(dtype, gen):
    x = rand((37, 257), dtype, gen=gen)
    gamma = rand((257,), dtype, gen=gen)
    dy = rand((37, 257), dtype, gen=gen)
    y, rstd = ops.rms_norm(x, gamma, 1e-6)
    dx, _ = ops.rms_norm_backward(dy, x, gamma, rstd)
    for lo, hi in [(0, 1), (5, 6), (3, 20), (36, 37)]:
        y1, r1 = ops.rms_norm(x[lo:hi], gamma, 1e-6)
        dx1, _ = ops.rms_norm_backward(dy[lo:hi], x[lo:hi], gamma, r1)
        assert torch.equal(y1, y[lo:hi]) and torch.equal(r1, rstd[lo:hi]) and torch.equal(dx1, dx[lo:hi])


def test_non_contiguous_inputs(gen):
    base = rand((16, 64), torch.float32, gen=gen)
    x = base.t()  # [64, 16], not contiguous
    gamma = rand((32,), torch.float32, gen=gen)[::2]
    y, rstd = ops.rms_norm(x, gamma, 1e-6)
    y_c, rstd_c = ops.rms_norm(x.contiguous(), gamma.contiguous(), 1e-6)
    assert torch.equal(y, y_c) and torch.equal(rstd, rstd_c)


def test_threads_do_not_change_bits(gen):
    x = rand((300, 1000), torch.bfloat16, gen=gen)
    gamma = rand((1000,), torch.float32, gen=gen)
    dy = rand((300, 1000), torch.bfloat16, gen=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            y, rstd = ops.rms_norm(x, gamma, 1e-6)
            results.append((y, rstd, *ops.rms_norm_backward(dy, x, gamma, rstd)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("gamma_f32", [False, True], ids=["gamma=x", "gamma=f32"])
def test_add_rms_norm(dtype, gamma_f32, gen):
    shape, h = (6, 5, 129), 129
    x1, x2 = rand(shape, dtype, gen=gen), rand(shape, dtype, gen=gen)
    gamma = rand((h,), torch.float32 if gamma_f32 else dtype, gen=gen)
    y, rstd, s = ops.add_rms_norm(x1, x2, gamma, 1e-6)
    # x_sum is torch's own x1 + x2 bit for bit; y and rstd are RmsNorm of it.
    assert torch.equal(s, x1 + x2)
    y_ref, rstd_ref = ops.rms_norm(s, gamma, 1e-6)
    assert torch.equal(y, y_ref) and torch.equal(rstd, rstd_ref)
    y64, r64, _, _ = reference(s, gamma, 1e-6, torch.zeros_like(s))
    check_forward(y, rstd, s, gamma, y64, r64, "add_rms_norm")
    # Backward with a residual gradient: dx = RmsNormGrad + dx_sum, one rounding.
    dy, dres = rand(shape, dtype, gen=gen), rand(shape, dtype, gen=gen)
    dx, dg = ops.add_rms_norm_backward(dy, s, gamma, rstd, dres)
    _, r64, dx64, dg64 = reference(s, gamma, 1e-6, dy, dres)
    check_backward(dx, dg, s, gamma, dy, r64, dx64, dg64, "add_rms_norm")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_autograd_functions(dtype, gen):
    """npukern_torch.rms_norm / add_rms_norm under autograd against
    torch.autograd.grad of the float64 composite."""
    import npukern_torch

    x1 = rand((4, 3, 24), dtype, gen=gen).requires_grad_()
    x2 = rand((4, 3, 24), dtype, gen=gen).requires_grad_()
    gamma = rand((3, 24), dtype, gen=gen).requires_grad_()
    w = rand((4, 3, 24), dtype, gen=gen)
    y, rstd, s = npukern_torch.add_rms_norm(x1, x2, gamma, 1e-6)
    assert not rstd.requires_grad
    y2, _ = npukern_torch.rms_norm(y, gamma, 1e-6)
    loss = (y2.float() * w.float()).sum() + s.float().sum()
    g1, g2, gg = torch.autograd.grad(loss, (x1, x2, gamma))
    assert torch.equal(g1, g2)

    a, b, g = (t.detach().double().requires_grad_() for t in (x1, x2, gamma))
    s64 = a + b

    def comp(v):
        return v * torch.rsqrt(v.pow(2).mean((-2, -1), keepdim=True) + 1e-6) * g

    loss64 = (comp(comp(s64)) * w.double()).sum() + s64.sum()
    r1, _, rg = torch.autograd.grad(loss64, (a, b, g))
    # Two chained norms in a low precision: compare in units of the
    # gradient's own scale (max |ref|), a relative 2^-(mantissa bits - 2).
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for got, ref, what in ((g1, r1, "dx"), (gg, rg, "dgamma")):
        err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
        record(f"autograd chain {what} max-normalized ({dtype})", err)
        assert err <= tol, f"{what}: {err}"


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_module_matches_torch_rmsnorm(dtype, gen):
    import npukern_torch

    ref = torch.nn.RMSNorm([4, 16])
    mod = npukern_torch.RMSNorm([4, 16])
    assert isinstance(mod, torch.nn.RMSNorm) and mod.eps is None
    with torch.no_grad():
        ref.weight.copy_(rand((4, 16), torch.float32, gen=gen))
    mod.load_state_dict(ref.state_dict())
    x = rand((3, 4, 16), dtype, gen=gen)
    y = mod(x)
    # eps=None: torch's finfo(float32).eps for every kernel dtype.
    y64, _, _, _ = reference(x, mod.weight, torch.finfo(torch.float32).eps, torch.zeros_like(x))
    assert ulps(y, y64).max() <= (1.0 if dtype in HALF else 16.0)
    assert y.dtype == ref(x).dtype == dtype
    # Gradients flow to x and the float32 weight.
    y.float().sum().backward()
    assert mod.weight.grad is not None and mod.weight.grad.dtype == torch.float32


def test_module_without_affine_and_float64_fallback(gen):
    import npukern_torch

    mod = npukern_torch.RMSNorm(8, eps=1e-5, elementwise_affine=False)
    assert mod.weight is None and "_ones" not in mod.state_dict()
    x = rand((5, 8), torch.float32, gen=gen)
    y64, _, _, _ = reference(x, torch.ones(8), 1e-5, torch.zeros_like(x))
    assert ((mod(x).double() - y64).abs() <= 2e-6 * y64.abs()).all()
    x64 = x.double()
    assert torch.equal(mod(x64), torch.nn.RMSNorm(8, eps=1e-5, elementwise_affine=False)(x64))


def test_add_rms_norm_module(gen):
    import npukern_torch

    mod = npukern_torch.AddRMSNorm(32, eps=1e-6)
    x, r = rand((4, 32), torch.bfloat16, gen=gen), rand((4, 32), torch.bfloat16, gen=gen)
    y, s = mod(x, r)
    assert torch.equal(s, x + r)
    assert torch.equal(y, npukern_torch.RMSNorm(32, eps=1e-6)(s))
