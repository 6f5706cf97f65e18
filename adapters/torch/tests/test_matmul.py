"""npukern's matmul through PyTorch: ``npukern::matmul`` /
``matmul_accumulate_`` / ``linear`` against the float64 reference (each
output within its dtype's half step plus float32 accumulation's bound
``K * 2^-24 * sum |a b|``), the same bits on 1 and 2 threads, the Linear
layer's backward (dx, dW summed in float32, db), errors, the route's rule,
the fused loss's head on it, and a patched model's projections."""

import pytest
import torch

import npukern_torch
from npukern_torch import functional as F
from npukern_torch import route

ops = torch.ops.npukern
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _r(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _check(got, a64, b64, dtype, k, what):
    """got (dtype) against the float64 product a64 @ b64: within half a step
    of the dtype at the exact value plus float32 accumulation's bound."""
    want = a64 @ b64
    bound = (a64.abs() @ b64.abs()) * (k * 2.0**-24) + want.abs() * EPS[dtype] + 1e-300
    err = (got.double() - want).abs()
    assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    assert bool((err <= bound).all()), f"{what}: worst {((err - bound) / bound).max().item()} over the bound"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (1, 37, 1), (7, 300, 33), (67, 129, 45), (200, 513, 70)])
def test_matmul_against_float64(dtype, ta, tb, mkn):
    m, k, n = mkn
    a = _r(*((k, m) if ta else (m, k)), dtype=dtype, seed=1)
    b = _r(*((n, k) if tb else (k, n)), dtype=dtype, seed=2)
    got = ops.matmul(a, b, ta, tb)
    a64, b64 = a.double(), b.double()
    _check(got, a64.t() if ta else a64, b64.t() if tb else b64, dtype, k, f"{mkn} {ta} {tb}")
    # float32 out: the same sums, unrounded.
    f = ops.matmul(a, b, ta, tb, torch.float32)
    assert f.dtype == torch.float32 and torch.equal(f.to(dtype), got)


def test_transposed_views_are_read_in_place_with_the_same_bits():
    a, b = _r(40, 90, dtype=torch.bfloat16, seed=3), _r(70, 90, dtype=torch.bfloat16, seed=4)
    want = ops.matmul(a, b, False, True)
    assert torch.equal(ops.matmul(a, b.t().contiguous().t(), False, True), want)
    assert torch.equal(ops.matmul(a, b.t()), want)  # b.t() is a view: read as trans_b
    assert torch.equal(ops.matmul(a.t().contiguous(), b, True, True), want)
    assert torch.equal(F.matmul(a[:, ::1], b, trans_b=True), want)
    # A view neither contiguous nor transposed-contiguous is copied.
    wide = _r(40, 180, dtype=torch.bfloat16, seed=5)
    assert torch.equal(ops.matmul(wide[:, ::2], b, False, True), ops.matmul(wide[:, ::2].contiguous(), b, False, True))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
def test_same_bits_on_one_and_two_threads(dtype):
    a, b = _r(300, 700, dtype=dtype, seed=6), _r(700, 600, dtype=dtype, seed=7)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.matmul(a, b)
        torch.set_num_threads(2)
        two = ops.matmul(a, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_accumulate_adds_into_float32_sums():
    a, b = _r(30, 50, dtype=torch.bfloat16, seed=8), _r(50, 20, dtype=torch.bfloat16, seed=9)
    c0 = _r(30, 20, seed=10)
    c = c0.clone()
    ops.matmul_accumulate_(c, a, b)
    want = c0.double() + a.double() @ b.double()
    bound = (c0.double().abs() + a.double().abs() @ b.double().abs()) * (51 * 2.0**-24)
    assert bool(((c.double() - want).abs() <= bound).all())
    with pytest.raises(TypeError, match="float32"):
        ops.matmul_accumulate_(c.to(torch.bfloat16), a, b)
    with pytest.raises(ValueError, match="shape"):
        ops.matmul_accumulate_(torch.zeros(20, 30), a, b)
    with pytest.raises(ValueError, match="contiguous"):
        ops.matmul_accumulate_(torch.zeros(1, 20).expand(30, 20), a, b)


def test_bad_input_is_refused():
    a, b = _r(4, 5), _r(6, 3)
    with pytest.raises(ValueError, match="summed dimension"):
        ops.matmul(a, b)
    with pytest.raises(ValueError, match="2-D"):
        ops.matmul(_r(2, 4, 5), _r(5, 3))
    with pytest.raises(TypeError):
        ops.matmul(a, _r(5, 3, dtype=torch.bfloat16))
    with pytest.raises(TypeError):
        ops.matmul(a.double(), _r(5, 3).double())
    with pytest.raises(TypeError, match="out_dtype"):
        ops.matmul(a, _r(5, 3), False, False, torch.float16)
    with pytest.raises(ValueError, match="in_features"):
        ops.linear(_r(3, 4), _r(5, 6))
    with pytest.raises(ValueError, match="bias"):
        ops.linear(_r(3, 6), _r(5, 6), _r(4))


def test_empty_products():
    assert ops.matmul(_r(0, 5), _r(5, 3)).shape == (0, 3)
    z = ops.matmul(_r(4, 0), _r(0, 3))
    assert z.shape == (4, 3) and bool((z == 0).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS.get)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_forward_and_backward_against_float64(dtype, bias):
    x = _r(3, 41, 96, dtype=dtype, seed=11).requires_grad_()
    w = _r(70, 96, dtype=dtype, seed=12, scale=0.1).requires_grad_()
    b = _r(70, dtype=dtype, seed=13).requires_grad_() if bias else None
    y = F.linear(x, w, b)
    dy = _r(3, 41, 70, dtype=dtype, seed=14)
    y.backward(dy)
    x64, w64, dy64 = x.detach().double().reshape(-1, 96), w.detach().double(), dy.double().reshape(-1, 70)
    if bias:
        # The bias starts the f32 sum: one rounding of x W^T + b.
        want = x64 @ w64.t() + b.detach().double()
        bound = ((x64.abs() @ w64.abs().t()) + b.detach().double().abs()) * (97 * 2.0**-24) + want.abs() * EPS[dtype]
        assert bool(((y.detach().double().reshape(-1, 70) - want).abs() <= bound).all())
        db = dy64.sum(0)
        assert bool(((b.grad.double() - db).abs() <= dy64.abs().sum(0) * 123 * 2.0**-24 + db.abs() * EPS[dtype]).all())
    else:
        _check(y.detach().reshape(-1, 70), x64, w64.t(), dtype, 96, "y")
    _check(x.grad.reshape(-1, 96), dy64, w64, dtype, 70, "dx")
    _check(w.grad, dy64.t(), x64, dtype, 123, "dW")  # summed over all 123 tokens in f32, rounded once


def test_linear_double_backward_and_gradcheck():
    x = torch.randn(4, 6, dtype=torch.float32, requires_grad=True)
    w = torch.randn(5, 6, dtype=torch.float32, requires_grad=True)
    y = F.linear(x, w)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    (gw,) = torch.autograd.grad(gx.sum(), w)
    x2, w2 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (gx2,) = torch.autograd.grad(torch.nn.functional.linear(x2, w2).square().sum(), x2, create_graph=True)
    (gw2,) = torch.autograd.grad(gx2.sum(), w2)
    torch.testing.assert_close(gw.double(), gw2, rtol=1e-5, atol=1e-5)


def test_linear_takes_what_f_linear_takes():
    # float64, mixed dtypes, 1-D input: F.linear's result.
    x, w = torch.randn(3, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    assert torch.equal(F.linear(x, w), torch.nn.functional.linear(x, w))
    v = _r(8)
    torch.testing.assert_close(F.linear(v, w.float()), torch.nn.functional.linear(v, w.float()))
    assert F.linear(v, w.float()).shape == (4,)
    # Autocast: the operands cast to its dtype first, a bf16 result.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(_r(3, 8), w.float())
    assert y.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # float64 is not cast by autocast: F.linear's float64 result.
        d = F.linear(x, w)
        assert d.dtype == torch.float64 and torch.equal(d, torch.nn.functional.linear(x, w))
    assert torch.equal(y, ops.linear(_r(3, 8).bfloat16(), w.float().bfloat16()))


def test_compile_traces_linear():
    w = torch.nn.Parameter(torch.randn(16, 32))
    x = torch.randn(4, 32, requires_grad=True)
    dy = torch.randn(4, 16)

    def f(x):
        return F.linear(x, w)

    eager = f(x)
    eager.backward(dy)
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad, w.grad = None, None
    compiled = torch.compile(f, fullgraph=True)(x)
    compiled.backward(dy)
    # The op's own bits, compiled or not (inductor keeps it a call).
    assert torch.equal(compiled, eager) and torch.equal(x.grad, gx) and torch.equal(w.grad, gw)


def test_route_rule_names_a_reason_for_every_dtype(monkeypatch):
    told = route.explain()
    assert set(told) == set(route.DTYPES) and all(isinstance(why, str) and why for _, why in told.values())
    vendor, flags, family = route._cpu()
    assert route.matmul_route(torch.float32) is False or "amx_tile" not in flags
    # float32 only where torch's sgemm is known slower (AMD Zen 5 and later).
    assert route.matmul_route(torch.float32) is (vendor == "AuthenticAMD" and family >= 26 and "avx512f" in flags
                                                 and "amx_tile" not in flags)
    monkeypatch.setenv("NPK_TORCH_MATMUL", "npukern")
    assert all(route.matmul_route(dt) for dt in route.DTYPES) and not route.matmul_route(torch.float64)
    monkeypatch.setenv("NPK_TORCH_MATMUL", "torch")
    assert not any(route.matmul_route(dt) for dt in route.DTYPES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=IDS.get)
def test_fused_loss_head_on_npukern_matches_float64(dtype):
    n, h, v = 150, 64, 300
    x = _r(n, h, dtype=dtype, seed=20).requires_grad_()
    w = _r(v, h, dtype=dtype, seed=21, scale=0.2).requires_grad_()
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(22))
    t[::7] = -100
    loss = npukern_torch.linear_cross_entropy(x, w, t, matmul="npukern", chunk_bytes=40 * v * x.element_size())
    loss.backward()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(x64 @ w64.t(), t)
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(loss.item() - ref.item()) <= tol * abs(ref.item())
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad)):
        rel = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert rel <= (1e-5 if dtype == torch.float32 else 2e-2), rel
    with pytest.raises(ValueError, match="matmul"):
        npukern_torch.linear_cross_entropy(x, w, t, matmul="oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=IDS.get)
def test_fused_loss_head_weight_grad_bits_do_not_depend_on_chunks(dtype):
    # One chunk writes the weight gradient in its dtype directly; several
    # write the float32 sums, then accumulate into them and round at the
    # end. Both are one chain per element (rows ascending) and one rounding,
    # so every chunking gives the same bits.
    n, h, v = 97, 40, 75
    x = _r(n, h, dtype=dtype, seed=30)
    w = _r(v, h, dtype=dtype, seed=31, scale=0.3)
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(32))
    t[::5] = -100
    grads = []
    for rows in (n, 40, 1):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        npukern_torch.linear_cross_entropy(xg, wg, t, matmul="npukern",
                                           chunk_bytes=rows * v * x.element_size()).backward()
        assert wg.grad.dtype == dtype and xg.grad.dtype == dtype
        grads.append((xg.grad, wg.grad))
    for dx, dw in grads[1:]:
        assert torch.equal(dx, grads[0][0]) and torch.equal(dw, grads[0][1])
    assert grads[0][1].abs().sum() > 0


def test_patched_model_projections_on_npukern(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from hf_models import build, tokens, twin
    from npukern_torch import hf

    del transformers
    stock = build("llama", torch.bfloat16, seed=5)
    forced, kept = twin(stock), twin(stock)
    counts = hf.patch(forced, linear="npukern")
    assert counts["linear"] == 14  # q, k, v, o, gate, up, down in each of the 2 layers
    assert hf.patch(kept, linear=False)["linear"] == 0
    monkeypatch.setenv("NPK_TORCH_MATMUL", "npukern")  # even where the rule would take it
    x = tokens(seed=4)
    losses = []
    for model in (stock, forced, kept):
        model.zero_grad()
        loss = model(x, labels=x).loss
        loss.backward()
        losses.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (ls, gs), (lf, gf), (lk, gk) = losses
    assert abs(lf - ls) <= 2e-2 * abs(ls)
    for a, b in zip(gs, gf):
        assert ((a.double() - b.double()).norm() / a.double().norm()).item() <= 5e-2
    # linear=False keeps torch's matmuls even where the route takes them:
    # the bits of the patch whose route keeps torch.
    monkeypatch.setenv("NPK_TORCH_MATMUL", "torch")
    routed_to_torch = twin(stock)
    hf.patch(routed_to_torch)
    routed_to_torch.zero_grad()
    loss = routed_to_torch(x, labels=x).loss
    loss.backward()
    assert loss.item() == lk
    assert all(torch.equal(p.grad, g) for p, g in zip(routed_to_torch.parameters(), gk))
    assert hf.unpatch(forced)["linear"] == 14
    assert all("forward" not in vars(m) for m in forced.modules())
