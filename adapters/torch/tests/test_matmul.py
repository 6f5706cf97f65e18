"""npukern's matmul through PyTorch: ``npukern::matmul`` /
``matmul_accumulate_`` / ``linear`` against the float64 reference (each
output within its dtype's half step plus float32 accumulation's bound
``K * 2^-24 * sum |a b|``), the same bits on 1 and 2 threads, the Linear
layer's backward (dx, dW summed in float32, db), errors, the route's rule,
the bf16 pair dot (``math=1``) bit for bit against a scalar model of
VDPBF16PS, Arm's (``math=2``) against one in exact fractions, the fused
loss's head on it, and a patched model's projections."""

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


def _flush(x):
    """float32 x with its subnormals as zeros of their sign (VDPBF16PS's DAZ/FTZ)."""
    return torch.where(x.abs() < 2.0**-126, x * 0, x)


def _fma_ftz(s, x, y):
    """s + x y as one VDPBF16PS step: rounded once (a bf16 product is exact
    in float32 at these magnitudes), then zero of its sign when tiny, which
    x86 decides after rounding to 24 bits with an unbounded exponent (a sum
    rounding up to 2^-126 from below 2^-126 - 2^-151 is tiny); the decision
    in float64 (tests/matmul_dot.rs's ``fma_ftz`` says why that is exact)."""
    r = s + x * y
    exact = s.double() + x.double() * y.double()
    return torch.where(exact.abs() < 2.0**-126 * (1 - 2.0**-25), r * 0, r)


def _pair_dot(a, b, c=None):
    """The bf16 pair dot of a [M, K] and b [K, N] (bfloat16) as VDPBF16PS sums:
    from c (flushed; zeros without), each pair of k steps as c = c + a[k+1]
    b[k+1], then c = c + a[k] b[k], each ``_fma_ftz``; an odd K's last step
    after a zero one. float32 [M, N]."""
    af, bf = _flush(a.float()), _flush(b.float())
    s = _flush(c.clone()) if c is not None else torch.zeros(a.shape[0], b.shape[1])
    k = a.shape[1]
    zero = torch.zeros(())
    for p in range(0, k, 2):
        if p + 1 < k:
            s = _fma_ftz(s, af[:, p + 1, None], bf[None, p + 1, :])
        else:
            s = _fma_ftz(s, zero, zero)
        s = _fma_ftz(s, af[:, p, None], bf[None, p, :])
    return s


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (3, 2, 5), (7, 37, 33), (67, 129, 45), (20, 600, 70)])
def test_bf16_pair_dot_is_the_models_bits(ta, tb, mkn):
    m, k, n = mkn
    a = _r(*((k, m) if ta else (m, k)), dtype=torch.bfloat16, seed=40)
    b = _r(*((n, k) if tb else (k, n)), dtype=torch.bfloat16, seed=41)
    want = _pair_dot(a.t() if ta else a, b.t() if tb else b)
    f = ops.matmul(a, b, ta, tb, torch.float32, 1)
    assert f.dtype == torch.float32 and torch.equal(f, want)
    assert torch.equal(ops.matmul(a, b, ta, tb, None, 1), want.to(torch.bfloat16))
    assert torch.equal(F.matmul(a, b, trans_a=ta, trans_b=tb, out_dtype=torch.float32, math="bf16_dot"), want)
    # Accumulated: c starts each sum.
    c0 = _r(m, n, seed=42)
    c = c0.clone()
    ops.matmul_accumulate_(c, a, b, ta, tb, 1)
    assert torch.equal(c, _pair_dot(a.t() if ta else a, b.t() if tb else b, c0))


def test_bf16_pair_dot_flushes_subnormals_and_differs_from_the_chain():
    # A subnormal input (2^-127 in bfloat16) is read as zero.
    a = torch.tensor([[2.0**-127, 2.0**-100]], dtype=torch.bfloat16)
    b = torch.tensor([[1.0], [2.0**-20]], dtype=torch.bfloat16)
    assert ops.matmul(a, b, False, False, torch.float32).item() == 2.0**-127 + 2.0**-120
    assert ops.matmul(a, b, False, False, torch.float32, 1).item() == 2.0**-120
    # A subnormal sum (2^-140) is written as zero; the chain keeps it.
    tiny = torch.tensor([[2.0**-70]], dtype=torch.bfloat16)
    assert ops.matmul(tiny, tiny, False, False, torch.float32, 1).item() == 0.0
    assert ops.matmul(tiny, tiny, False, False, torch.float32).item() == 2.0**-140


def test_bf16_pair_dot_detects_tininess_after_rounding():
    # 2^-126 - 2^-150 rounds (IEEE) up to 2^-126, but x86's FTZ, deciding
    # after rounding to 24 bits, flushes it (VDPBF16PS on Zen 5 gives 0);
    # 2^-126 - 2^-160 rounds to 2^-126 either way and stays. (Every ISA:
    # tests/matmul_dot.rs.)
    for e, want in [(-75, 0.0), (-80, 2.0**-126)]:
        a = torch.tensor([[0.0, 2.0**e]], dtype=torch.bfloat16)
        b = torch.tensor([[0.0], [-(2.0**e)]], dtype=torch.bfloat16)
        c = torch.full((1, 1), 2.0**-126)
        ops.matmul_accumulate_(c, a, b, False, False, 1)
        assert c.item() == want, e
        assert torch.equal(c, _pair_dot(a, b, torch.full((1, 1), 2.0**-126)))


def test_bf16_pair_dot_is_refused_for_other_dtypes_and_values():
    a, b = _r(4, 6), _r(6, 3)
    with pytest.raises(TypeError, match="bfloat16"):
        ops.matmul(a, b, False, False, None, 1)
    with pytest.raises(TypeError, match="bfloat16"):
        ops.matmul_accumulate_(torch.zeros(4, 3), a.half(), b.half(), False, False, 1)
    with pytest.raises(TypeError, match="bfloat16"):
        ops.linear(a, b.t().contiguous(), None, 1)
    with pytest.raises(ValueError, match="math"):
        ops.matmul(a.bfloat16(), b.bfloat16(), False, False, None, 3)
    with pytest.raises(TypeError, match="bfloat16"):
        ops.matmul(a, b, False, False, None, 2)
    with pytest.raises(ValueError, match="math"):
        F.matmul(a, b, math="fast")


def _odd(x):
    """The exact value x (a Fraction) as Arm's BFDOT rounds a sum: to odd at
    24 bits (truncated, the last bit set when inexact), below 2^-126 to a
    zero, 2^128 and beyond to infinity. A float32's bits."""
    import struct
    from fractions import Fraction
    sign = 0x80000000 if x < 0 else 0
    a = abs(x)
    if a < Fraction(2) ** -126:
        return sign
    if a >= Fraction(2) ** 128:
        return sign | 0x7F800000
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    q = a / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
    m = q.numerator // q.denominator
    if m != q:
        m |= 1
    return sign | (e + 127) << 23 | (m & 0x7FFFFF)


def _arm_dot(a, b):
    """Arm's pair dot (BFDotAdd per pair: the two products summed, then
    added to c, each rounded by ``_odd``; subnormal inputs read as zero; an
    odd K's last step with a zero one) in exact fractions. float32 bits
    [M, N] as a list of lists."""
    import struct
    from fractions import Fraction

    def f32(bits):
        return struct.unpack("<f", struct.pack("<I", bits))[0]

    def val(x):
        return Fraction(0) if abs(x) < 2.0**-126 else Fraction(x)

    af, bf = a.float().tolist(), b.float().tolist()
    k = a.shape[1]
    out = []
    for i in range(a.shape[0]):
        row = []
        for j in range(b.shape[1]):
            s = 0.0
            for p in range(0, k, 2):
                t = val(af[i][p]) * val(bf[p][j])
                if p + 1 < k:
                    t += val(af[i][p + 1]) * val(bf[p + 1][j])
                s = f32(_odd(Fraction(s) + Fraction(f32(_odd(t)))))
            row.append(s)
        out.append(row)
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("mkn", [(1, 1, 1), (3, 2, 5), (5, 9, 7), (4, 33, 17)])
def test_arm_pair_dot_is_the_models_bits(ta, tb, mkn):
    # math=2: Arm's BFDOT sums (its exact model off AArch64), against a
    # model in fractions; the same bits on one and two threads.
    m, k, n = mkn
    a = _r(*((k, m) if ta else (m, k)), dtype=torch.bfloat16, seed=50)
    b = _r(*((n, k) if tb else (k, n)), dtype=torch.bfloat16, seed=51)
    want = _arm_dot(a.t() if ta else a, b.t() if tb else b)
    got = F.matmul(a, b, trans_a=ta, trans_b=tb, out_dtype=torch.float32, math="bf16_dot_arm")
    assert torch.equal(got, want)
    assert torch.equal(ops.matmul(a, b, ta, tb, None, 2), want.to(torch.bfloat16))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(ops.matmul(a, b, ta, tb, torch.float32, 2), want)
    finally:
        torch.set_num_threads(before)


def test_arm_pair_dot_rounds_to_odd():
    # 1 + 2^-30, then + 2^-30: rounded to odd, the last bit stays set
    # (0x3f800001); VDPBF16PS's nearest-even FMAs and the chain give 1.
    a = torch.tensor([[1.0, 2.0**-15, 2.0**-15, 0.0]], dtype=torch.bfloat16)
    b = a.t().contiguous()
    got = ops.matmul(a, b, False, False, torch.float32, 2)
    assert got.view(torch.int32).item() == 0x3F800001
    assert ops.matmul(a, b, False, False, torch.float32, 1).item() == 1.0
    assert ops.matmul(a, b, False, False, torch.float32, 0).item() == 1.0


@pytest.mark.parametrize("bias", [False, True])
def test_linear_pair_dot_forward_and_backward_bits(bias):
    # Every product of the layer with the forward's math: y = x W^T (+ b,
    # starting the sums), dx = dy W, dW = dy^T x over all 123 tokens.
    x = _r(3, 41, 96, dtype=torch.bfloat16, seed=43).requires_grad_()
    w = _r(70, 96, dtype=torch.bfloat16, seed=44, scale=0.1).requires_grad_()
    b = _r(70, dtype=torch.bfloat16, seed=45).requires_grad_() if bias else None
    y = F.linear(x, w, b, math="bf16_dot")
    dy = _r(3, 41, 70, dtype=torch.bfloat16, seed=46)
    y.backward(dy)
    x2, dy2 = x.detach().reshape(-1, 96), dy.reshape(-1, 70)
    c0 = b.detach().float().expand(123, 70).contiguous() if bias else None
    assert torch.equal(y.detach().reshape(-1, 70), _pair_dot(x2, w.detach().t(), c0).to(torch.bfloat16))
    assert torch.equal(x.grad.reshape(-1, 96), _pair_dot(dy2, w.detach()).to(torch.bfloat16))
    assert torch.equal(w.grad, _pair_dot(dy2.t(), x2).to(torch.bfloat16))
    # The default without route is the chain (npk_matmul's bits).
    assert torch.equal(F.linear(x.detach(), w.detach()), ops.linear(x.detach(), w.detach()))


def test_routed_linear_sums_as_the_route_says(monkeypatch):
    x = _r(37, 64, dtype=torch.bfloat16, seed=47)
    w = _r(50, 64, dtype=torch.bfloat16, seed=48)
    monkeypatch.setenv("NPK_TORCH_MATMUL", "npukern")
    for math, m in (("bf16_dot", 1), ("chain", 0)):
        monkeypatch.setenv("NPK_TORCH_MATMUL_MATH", math)
        assert torch.equal(F.linear(x, w, route=True), ops.linear(x, w, None, m))
        assert torch.equal(F.matmul(x, w, trans_b=True, math="auto"), ops.matmul(x, w, False, True, None, m))
    # float32 is the chain whatever the math says.
    monkeypatch.setenv("NPK_TORCH_MATMUL_MATH", "bf16_dot")
    assert torch.equal(F.linear(x.float(), w.float(), route=True), ops.linear(x.float(), w.float()))


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
    monkeypatch.delenv("NPK_TORCH_MATMUL", raising=False)
    monkeypatch.delenv("NPK_TORCH_MATMUL_MATH", raising=False)
    told = route.explain()
    assert set(told) == set(route.DTYPES) and all(isinstance(why, str) and why for _, why in told.values())
    vendor, flags, family = route._cpu()
    assert route.matmul_route(torch.float32) is False or "amx_tile" not in flags
    # float32 only where torch's sgemm is known slower (AMD Zen 5 and later).
    assert route.matmul_route(torch.float32) is (vendor == "AuthenticAMD" and family >= 26 and "avx512f" in flags
                                                 and "amx_tile" not in flags)
    # bfloat16 on AMD with AVX512-BF16 (Zen 4 and later) is summed by npukern's pair dot when npukern
    # runs it; npukern takes it on Zen 5 and later (the step faster), torch keeps it on Zen 4.
    pair = vendor == "AuthenticAMD" and family >= 25 and "avx512_bf16" in flags and "amx_tile" not in flags
    assert (route.matmul_math(torch.bfloat16) == route.BF16_DOT) is pair
    if pair:
        assert route.matmul_route(torch.bfloat16) is (family >= 26)
    assert route.matmul_math(torch.float32) == route.matmul_math(torch.float16) == route.CHAIN
    monkeypatch.setenv("NPK_TORCH_MATMUL", "npukern")
    assert all(route.matmul_route(dt) for dt in route.DTYPES) and not route.matmul_route(torch.float64)
    monkeypatch.setenv("NPK_TORCH_MATMUL", "torch")
    assert not any(route.matmul_route(dt) for dt in route.DTYPES)
    monkeypatch.setenv("NPK_TORCH_MATMUL_MATH", "chain")
    assert route.matmul_math(torch.bfloat16) == route.CHAIN
    monkeypatch.setenv("NPK_TORCH_MATMUL_MATH", "bf16_dot")
    assert route.matmul_math(torch.bfloat16) == route.BF16_DOT and route.matmul_math(torch.float32) == route.CHAIN
    assert "NPK_TORCH_MATMUL_MATH" in route.explain()[torch.bfloat16][1] or pair


# (vendor, family, flags) of the CPUs the rule names, and what it gives
# bfloat16: (npukern takes it, summed by the pair dot when it does or is forced to).
_CPUS = {
    "zen5": ("AuthenticAMD", 26, {"avx2", "fma", "avx512f", "avx512_bf16"}, (True, True)),
    "zen4": ("AuthenticAMD", 25, {"avx2", "fma", "avx512f", "avx512_bf16"}, (False, True)),
    "zen3": ("AuthenticAMD", 25, {"avx2", "fma"}, (True, False)),
    "cooper_lake": ("GenuineIntel", 6, {"avx2", "fma", "avx512f", "avx512_bf16"}, (True, False)),
    "sapphire_rapids": ("GenuineIntel", 6, {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"}, (False, False)),
    "cascade_lake": ("GenuineIntel", 6, {"avx2", "fma", "avx512f"}, (True, False)),
    "arm": ("", 0, {"asimd", "bf16"}, (False, False)),
}


@pytest.mark.parametrize("cpu", sorted(_CPUS))
def test_route_rule_for_bfloat16_by_cpu(monkeypatch, cpu):
    vendor, family, flags, (takes, pair) = _CPUS[cpu]
    monkeypatch.setattr(route, "_cpu", lambda: (vendor, flags, family))
    assert route._rule(torch.bfloat16)[0] is takes
    assert route._pair_dot_cpu(vendor, flags, family) is pair
    # float32 goes to npukern on Zen 5 alone; float16 is never summed by the pair dot.
    assert route._rule(torch.float32)[0] is (cpu == "zen5")


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


@pytest.mark.parametrize("math", ["chain", "bf16_dot", "bf16_dot_arm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=IDS.get)
def test_fused_loss_head_weight_grad_bits_do_not_depend_on_chunks(monkeypatch, dtype, math):
    # One chunk writes the weight gradient in its dtype directly; several
    # write the float32 sums, then accumulate into them and round at the
    # end. Both are one chain per element (rows ascending) and one rounding,
    # so every chunking gives the same bits. The bf16 pair dots sum tokens
    # two at a time: the head cuts even chunks (an odd budget, 41 or 1 rows,
    # rounded to 40 or 2), so the pairs are the same in every chunking.
    if math != "chain" and dtype != torch.bfloat16:
        pytest.skip("the pair dot is bfloat16's")
    monkeypatch.setenv("NPK_TORCH_MATMUL_MATH", math)
    n, h, v = 97, 40, 75
    x = _r(n, h, dtype=dtype, seed=30)
    w = _r(v, h, dtype=dtype, seed=31, scale=0.3)
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(32))
    t[::5] = -100
    grads = []
    for rows in (n, 40, 41, 1):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        npukern_torch.linear_cross_entropy(xg, wg, t, matmul="npukern",
                                           chunk_bytes=rows * v * x.element_size()).backward()
        assert wg.grad.dtype == dtype and xg.grad.dtype == dtype
        grads.append((xg.grad, wg.grad))
    for dx, dw in grads[1:]:
        assert torch.equal(dx, grads[0][0]) and torch.equal(dw, grads[0][1])
    assert grads[0][1].abs().sum() > 0


class _Recorder:
    """torch.ops.npukern with its matmul calls recorded: (a's rows, trans_b, math)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        op = getattr(ops, name)
        if name != "matmul":
            return op

        def call(a, b, trans_a=False, trans_b=False, out_dtype=None, math=0):
            self.calls.append((a.shape[0], trans_b, math))
            return op(a, b, trans_a, trans_b, out_dtype, math)

        return call


@pytest.mark.parametrize("budget", [41, 1, 40, 97])
def test_fused_loss_head_pair_dot_cuts_even_chunks(monkeypatch, budget):
    # The weight gradient's K is the tokens: the pair dot sums them two at a
    # time, so a chunk of odd rows before another would pair differently
    # from one call (its float32 sums differ; rounded to bfloat16 they
    # rarely show). Every chunk but the last is even, with the pair dot.
    from npukern_torch import loss as loss_mod

    n, h, v = 97, 40, 75
    x = _r(n, h, dtype=torch.bfloat16, seed=33).requires_grad_()
    w = _r(v, h, dtype=torch.bfloat16, seed=34, scale=0.3).requires_grad_()
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(35))
    for math, m in (("bf16_dot", 1), ("chain", 0)):
        monkeypatch.setenv("NPK_TORCH_MATMUL_MATH", math)
        rec = _Recorder()
        monkeypatch.setattr(loss_mod, "ops", rec)
        npukern_torch.linear_cross_entropy(x, w, t, matmul="npukern", chunk_bytes=budget * v * 2).backward()
        chunks = [rows for rows, trans_b, _ in rec.calls if trans_b]  # the logits x W^T, one per chunk
        assert sum(chunks) == n and all(c == m for _, _, c in rec.calls)
        want = max(2, budget - budget % 2) if m and budget < n else budget
        assert chunks[:-1] == [want] * (len(chunks) - 1) and 0 < chunks[-1] <= want
    # Why: the pair dot's float32 sums over odd chunks are not one call's.
    a, xb = _r(n, v, dtype=torch.bfloat16, seed=36), _r(n, h, dtype=torch.bfloat16, seed=37)
    whole = ops.matmul(a, xb, True, False, torch.float32, 1)
    for rows, same in ((40, True), (41, False)):
        sums = ops.matmul(a[:rows], xb[:rows], True, False, torch.float32, 1)
        for start in range(rows, n, rows):
            ops.matmul_accumulate_(sums, a[start:start + rows], xb[start:start + rows], True, False, 1)
        assert torch.equal(sums, whole) is same


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


def test_set_flush_denormal_changes_no_bit():
    # torch.set_flush_denormal(True) sets FTZ/DAZ on the calling thread only:
    # npukern's blocks there flushed and the pool's did not, so 2 threads
    # gave other bits than 1. Every block now runs under the default modes.
    a = torch.full((1024, 64), 2.0**-70, dtype=torch.bfloat16)
    b = torch.full((64, 1024), 2.0**-70, dtype=torch.bfloat16)
    x = _r(64, 1000, seed=43) * 2.0**-130  # subnormal float32 rows
    w = _r(1000, seed=44)
    threads = torch.get_num_threads()
    ops = torch.ops.npukern

    def run():
        return (
            ops.matmul(a, b, False, False, torch.float32),
            ops.matmul(a, b, False, False, torch.float32, 1),
            ops.rms_norm(x, w, 1e-6)[0],
        )

    try:
        torch.set_num_threads(2)
        want = run()  # the pool's threads start under the default modes
        assert bool((want[0] != 0).all()) and bool((want[2] != 0).any())
        torch.set_flush_denormal(True)
        assert torch.tensor([2.0**-70]).square().item() == 0.0, "no flush: the test cannot fail"
        for t in (1, 2):
            torch.set_num_threads(t)
            for g, w_ in zip(run(), want):
                assert torch.equal(g.view(torch.int32), w_.view(torch.int32)), t
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)
