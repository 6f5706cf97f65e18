"""add_rms_norm_ (x1 + x2 written over x1: IPEX's add_rms_norm with
add_back=True): the out-of-place op's bits, refusals that leave x1 as it
was, autograd, opcheck and torch.compile."""

import pytest
import torch

import npukern_torch
from conftest import DTYPES, backward_compiled_and_eager, rand, same_bits

ops = torch.ops.npukern

# (x shape, trailing dims gamma covers): decode rows, odd lengths, a row
# split across UB tiles (split-D: x1 read twice before it is written), rows
# enough for several threads, 3-D and 4-D inputs.
SHAPES = [
    ((1, 4096), 1),
    ((1, 4097), 1),
    ((3, 4097), 1),
    ((2, 70001), 1),
    ((16, 4097), 1),
    ((2, 3, 129), 1),
    ((2, 3, 4, 8), 2),
]


def _inputs(shape, gdims, dtype, gen, gamma_dtype=None):
    x1, x2 = rand(shape, dtype, gen=gen), rand(shape, dtype, gen=gen)
    gamma = rand(shape[-gdims:], gamma_dtype or dtype, 0.5, 1.5, gen=gen)
    return x1, x2, gamma


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,gdims", SHAPES, ids=lambda v: str(v))
def test_bits_of_the_out_of_place_op(shape, gdims, dtype, gen):
    x1, x2, gamma = _inputs(shape, gdims, dtype, gen)
    y, rstd, x_sum = ops.add_rms_norm(x1, x2, gamma, 1e-6)
    res = x1.clone()
    version = res._version
    y_, rstd_ = ops.add_rms_norm_(res, x2, gamma, 1e-6)
    assert same_bits(y_, y) and same_bits(rstd_, rstd) and same_bits(res, x_sum)
    assert res._version == version + 1
    assert y_.data_ptr() != res.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "args", [(1e-5, 0.0, False), (1e-6, 1.0, False), (1e-6, 0.0, True)], ids=["eps", "offset", "cast_before_gamma"]
)
def test_options_and_f32_gamma(args, dtype, gen):
    x1, x2, gamma = _inputs((3, 5, 96), 1, dtype, gen, torch.float32)
    y, rstd, x_sum = ops.add_rms_norm(x1, x2, gamma, *args)
    res = x1.clone()
    y_, rstd_ = ops.add_rms_norm_(res, x2, gamma, *args)
    assert same_bits(y_, y) and same_bits(rstd_, rstd) and same_bits(res, x_sum)


@pytest.mark.parametrize("casting", ["torch", "llama", "gemma"])
@pytest.mark.parametrize("gamma_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_python_entry_matches_add_rms_norm(casting, gamma_dtype, gen):
    # llama with a float32 gamma and a bfloat16 x: y is the promoted product.
    x1, x2, gamma = _inputs((2, 7, 64), 1, torch.bfloat16, gen, gamma_dtype)
    y, rstd, x_sum = npukern_torch.add_rms_norm(x1, x2, gamma, 1e-6, casting=casting)
    res = x1.clone()
    y_, rstd_ = npukern_torch.add_rms_norm_(res, x2, gamma, 1e-6, casting=casting)
    assert same_bits(y_, y) and same_bits(rstd_, rstd) and same_bits(res, x_sum)
    assert "add_rms_norm_" in npukern_torch.__all__ and "add_back" in npukern_torch.add_rms_norm_.__doc__


def _refusals():
    x2, gamma = torch.randn(4, 8), torch.randn(8)
    base = torch.randn(4, 8)
    square = torch.randn(8, 8)
    return [
        # (x1, x2, gamma, exception, message)
        (torch.randn(8, 4).t(), x2, gamma, ValueError, "x1 must be contiguous"),
        (torch.randn(4, 16)[:, ::2], x2, gamma, ValueError, "x1 must be contiguous"),
        (torch.randn(4, 8, dtype=torch.bfloat16), x2, gamma, TypeError, "dtype"),
        (torch.randn(4, 8, dtype=torch.float64), x2.double(), gamma, TypeError, "dtype"),
        (base, base, gamma, ValueError, "shares memory with x2"),
        (base[:2], base[1:3], gamma, ValueError, "shares memory with x2"),
        (square, square.t(), gamma, ValueError, "shares memory with x2"),
        (base, x2, base[1], ValueError, "shares memory with gamma"),
        (torch.randn(1, 8).expand(4, 8), x2, gamma, ValueError, "sharing memory"),
        (torch.randn(8).expand(4, 8), x2, gamma, ValueError, "sharing memory"),
        (torch.randn(3, 8), x2, gamma, ValueError, "shape"),
        (torch.randn(4, 8), x2, torch.randn(9), ValueError, "gamma"),
    ]


@pytest.mark.parametrize("i", range(len(_refusals())))
def test_refusals_leave_x1_unchanged(i):
    x1, x2, gamma, exc, message = _refusals()[i]
    before, other = x1.clone(), x2.clone()
    with pytest.raises(exc, match=message):
        ops.add_rms_norm_(x1, x2, gamma, 1e-6)
    assert same_bits(x1, before) and same_bits(x2, other)


def test_autograd_refusals_leave_x1_unchanged():
    x2, gamma = torch.randn(4, 8, requires_grad=True), torch.randn(8)
    leaf = torch.randn(4, 8, requires_grad=True)
    view = torch.randn(2, 4, 8)[1]  # a view: autograd cannot rebase it onto a node with two outputs
    for x1, message in ((leaf, "leaf Variable"), (view, "view of another tensor")):
        before = x1.detach().clone()
        with pytest.raises(RuntimeError, match=message):
            ops.add_rms_norm_(x1, x2, gamma, 1e-6)
        assert same_bits(x1.detach(), before)
    # Without grad the same tensors are written (torch's rule for in-place ops).
    with torch.no_grad():
        ops.add_rms_norm_(leaf, x2, gamma, 1e-6)
        ops.add_rms_norm_(view, x2, gamma, 1e-6)
    with torch.inference_mode():
        t = torch.randn(4, 8)
    before = t.clone()
    with pytest.raises(RuntimeError, match="inference tensor outside InferenceMode"):
        ops.add_rms_norm_(t, x2, gamma, 1e-6)
    assert same_bits(t, before)


def test_no_grad_and_inference_mode(gen):
    x1, x2, gamma = _inputs((1, 4096), 1, torch.bfloat16, gen)
    y, rstd, x_sum = ops.add_rms_norm(x1, x2, gamma, 1e-6)
    gamma.requires_grad_()
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            res = x1.clone()
            y_, rstd_ = ops.add_rms_norm_(res, x2, gamma, 1e-6)
        assert same_bits(y_, y) and same_bits(rstd_, rstd) and same_bits(res, x_sum)
        assert not y_.requires_grad and res.grad_fn is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("x1_grad", [True, False], ids=["x1 grad", "x1 no grad"])
def test_autograd_matches_the_out_of_place_op(x1_grad, dtype, gen):
    """Gradients of x1 (before it is overwritten), x2 and gamma, through y and
    the sum, bit for bit those of add_rms_norm."""
    x1, x2, gamma = _inputs((2, 3, 96), 1, dtype, gen)
    x1.requires_grad_(x1_grad)
    x2.requires_grad_()
    gamma.requires_grad_()
    dy, ds = rand((2, 3, 96), dtype, gen=gen), rand((2, 3, 96), dtype, gen=gen)
    wrt = (x1, x2, gamma) if x1_grad else (x2, gamma)

    y, rstd, x_sum = ops.add_rms_norm(x1, x2, gamma, 1e-6)
    expected = torch.autograd.grad((y, x_sum), wrt, (dy, ds))

    res = x1.clone()  # the residual stream: not a leaf, so writable in place
    y_, rstd_ = ops.add_rms_norm_(res, x2, gamma, 1e-6)
    assert res.requires_grad and res.grad_fn is y_.grad_fn and not rstd_.requires_grad
    assert same_bits(y_.detach(), y.detach()) and same_bits(res.detach(), x_sum.detach())
    got = torch.autograd.grad((y_, res), wrt, (dy, ds))
    for a, b in zip(got, expected):
        assert same_bits(a, b)


def test_autograd_sees_a_later_write_and_double_backward(gen):
    x1, x2, gamma = (t.requires_grad_() for t in _inputs((3, 32), 1, torch.float32, gen))
    res = x1 * 1
    y, _ = ops.add_rms_norm_(res, x2, gamma, 1e-6)
    res.add_(1)  # overwrites the x_sum the backward reads
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    # create_graph=True: the differentiable composite, as for add_rms_norm.
    def second_order(op):
        res = x1 * 1
        y = op(res, x2, gamma, 1e-6)[0]
        (g,) = torch.autograd.grad(y.square().sum(), x2, create_graph=True)
        return torch.autograd.grad(g.sum(), (x1, gamma))

    for a, b in zip(second_order(ops.add_rms_norm_), second_order(ops.add_rms_norm)):
        assert same_bits(a, b)


def test_compiled_autograd(gen):
    x1, x2, gamma = _inputs((4, 16), 1, torch.float32, gen)

    def grads(backward):
        xx, gg = x1.clone().requires_grad_(), gamma.clone().requires_grad_()
        res = xx * 1
        y, _ = ops.add_rms_norm_(res, x2, gg, 1e-6)
        backward((y * res).sum())
        return xx.grad, gg.grad

    for a, b in zip(*backward_compiled_and_eager(grads)):
        assert same_bits(a, b)


def _r(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


@pytest.mark.parametrize(
    "args",
    [
        lambda: (_r(5, 24), _r(5, 24), _r(24), 1e-6),
        lambda: (_r(5, 24), _r(5, 24, grad=True), _r(24, grad=True), 1e-6),
        lambda: (_r(2, 3, 16, dtype=torch.bfloat16), _r(2, 3, 16, dtype=torch.bfloat16), _r(16), 1e-5, 0.5, True),
    ],
    ids=["no grad", "grad", "bf16 options"],
)
def test_opcheck(args):
    torch.library.opcheck(ops.add_rms_norm_, args())


def test_compile_fullgraph(gen):
    """A decode step's residual update compiled (no grad: IPEX's use), and
    one under autograd."""
    res, x, w = _inputs((1, 4097), 1, torch.bfloat16, gen)

    def step(res, x, w):
        y, _ = npukern_torch.add_rms_norm_(res, x * 2, w, 1e-6)
        return y * 3

    compiled = torch.compile(step, fullgraph=True)
    with torch.no_grad():
        ra, rb = res.clone(), res.clone()
        assert same_bits(compiled(ra, x, w), step(rb, x, w)) and same_bits(ra, rb)

    xg = torch.randn(2, 5, 64, generator=gen).requires_grad_()
    wg = torch.randn(64, generator=gen).requires_grad_()

    # Around the op only exact operations (scaling by powers of two, one
    # product), so compiled and eager terms have the same bits whatever
    # Inductor fuses; sin/cos here differed by Inductor's ulps.
    def terms(x, w):
        res = x * 0.5
        y, _ = npukern_torch.add_rms_norm_(res, x * 2, w, 1e-6)
        return y * res

    t_c, t_e = torch.compile(terms, fullgraph=True)(xg, wg), terms(xg, wg)
    assert same_bits(t_c, t_e)
    # The loss: the same terms summed in Inductor's order and in eager's, so
    # within the bound of any order, (n - 1) u sum|t|.
    loss_c, loss_e = torch.compile(lambda x, w: terms(x, w).sum(), fullgraph=True)(xg, wg), t_e.sum()
    bound = (t_e.numel() - 1) * 2.0**-24 * float(t_e.detach().abs().sum())
    torch.testing.assert_close(loss_c, loss_e, rtol=0, atol=bound)
    for a, b in zip(torch.autograd.grad(loss_c, (xg, wg)), torch.autograd.grad(loss_e, (xg, wg))):
        torch.testing.assert_close(a, b)
