"""The eager caller the functional forms and modules use (npukern_torch/_fast.py,
csrc/fast_call.cpp) against the torch.ops overload it stands for: the same
bits, the same errors, the same autograd, and torch.ops' own behaviour for
everything it hands back (keywords, subclasses, __torch_function__ modes,
fake tensors, torch.compile)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from npukern_torch import functional as F

ops = torch.ops.npukern


def _r(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


def cases():
    """(eager caller, overload, positional args) for every op the package calls eagerly."""
    q, k = _r(1, 5, 4, 8, dtype=torch.bfloat16), _r(1, 5, 2, 8, dtype=torch.bfloat16)
    cos, sin = _r(1, 5, 1, 8, dtype=torch.bfloat16), _r(1, 5, 1, 8, dtype=torch.bfloat16)
    return [
        (F._rms_norm_op, ops.rms_norm.default, (_r(3, 37, dtype=torch.bfloat16), _r(37, dtype=torch.bfloat16), 1e-6)),
        (F._rms_norm_op, ops.rms_norm.default, (_r(2, 3, 16), _r(3, 16), 1e-5, 1.0, True)),
        (F._rms_norm_op, ops.rms_norm.default, (_r(4, 8), _r(8), 1)),  # an int where the schema says float
        (F._rms_norm_op, ops.rms_norm.default, (_r(4, 8), _r(8), 1e-6, 0.0, 1)),  # and for a bool (torch.ops takes it)
        (F._add_rms_norm_op, ops.add_rms_norm.default, (_r(5, 24), _r(5, 24), _r(24), 1e-6, 0.0, False)),
        (F._embedding_op, ops.embedding.default, (_r(6, 5), torch.tensor([[0, 3, 3], [5, 1, 3]]), 3, True)),
        (F._swiglu_op, ops.swiglu.default, (_r(3, 2, 10, dtype=torch.float16), 1, True)),
        (F._silu_mul_op, ops.silu_mul.default, (_r(4, 9), _r(4, 9))),
        (F._geglu_op, ops.geglu.default, (_r(3, 10, dtype=torch.bfloat16), -1, 1, False, True)),
        (F._gelu_mul_op, ops.gelu_mul.default, (_r(4, 9), _r(4, 9), 0)),
        (F._rotary_mul_op, ops.rotary_mul.default, (q, cos, sin, True)),
        (F._rope_qk_op, ops.rope_qk.default, (q, k, cos, sin, False, True)),
    ]


def _same(a, b):
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
        assert torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x, y)


@pytest.mark.parametrize("i", range(len(cases())))
def test_same_result_as_the_overload(i):
    fast, overload, args = cases()[i]
    assert fast is not overload  # the eager caller is in use
    _same(fast(*args), overload(*args))


def test_in_place_writes_and_bumps_the_version():
    x1, x2, g = _r(4, 12), _r(4, 12), _r(12)
    a, b = x1.clone(), x1.clone()
    va, vb = a._version, b._version
    ya = F._add_rms_norm_inplace_op(a, x2, g, 1e-6)
    yb = ops.add_rms_norm_.default(b, x2, g, 1e-6)
    _same(ya, yb)
    assert torch.equal(a, b) and torch.equal(a, x1 + x2)
    assert a._version - va == b._version - vb > 0


def test_autograd_through_the_eager_caller():
    x, g = _r(3, 16, grad=True), _r(16, grad=True)
    y, _ = F._rms_norm_op(x, g, 1e-6)
    y.square().sum().backward()
    x2, g2 = x.detach().clone().requires_grad_(), g.detach().clone().requires_grad_()
    y2, _ = ops.rms_norm.default(x2, g2, 1e-6)
    y2.square().sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(g.grad, g2.grad)
    with torch.inference_mode():
        assert F._rms_norm_op(x, g, 1e-6)[0].is_inference()


def test_parameters_are_taken():
    x, w = _r(2, 8), torch.nn.Parameter(_r(8))
    _same(F._rms_norm_op(x, w, 1e-6), ops.rms_norm.default(x, w, 1e-6))


def test_errors_are_torch_ops_errors():
    bad = [
        (_r(4, 8, dtype=torch.float64), _r(8, dtype=torch.float64), 1e-6),  # a dtype the kernels do not take
        (_r(4, 8), _r(7), 1e-6),  # gamma's shape
        (_r(4, 8), _r(8), "1e-6"),  # an argument of the wrong type
        (_r(4, 8), _r(8), 1e-6, 0.0, False, 7),  # too many arguments
        (_r(4, 8),),  # too few
        (_r(4, 8), None, 1e-6),
    ]
    for args in bad:
        with pytest.raises(Exception) as want:
            ops.rms_norm.default(*args)
        with pytest.raises(want.type) as got:
            F._rms_norm_op(*args)
        assert str(got.value) == str(want.value)


def test_keywords_go_to_the_overload():
    x, g = _r(3, 8), _r(8)
    _same(F._rms_norm_op.fast(x, g, epsilon=1e-3), ops.rms_norm.default(x, g, 1e-3))
    _same(F._rms_norm_op.fast(x, gamma=g), ops.rms_norm.default(x, g))


class _Logged(torch.Tensor):
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def test_subclasses_and_modes_see_the_call():
    x, g = _r(3, 8), _r(8)
    _Logged.seen.clear()
    y, _ = F._rms_norm_op(x.as_subclass(_Logged), g, 1e-6)
    assert ops.rms_norm.default in _Logged.seen

    class Mode(TorchFunctionMode):
        seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Mode.seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        F._silu_mul_op(x, x)
    assert ops.silu_mul.default in Mode.seen


def test_fake_tensors_and_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y, rstd = F._rms_norm_op(torch.empty(5, 64), torch.empty(64), 1e-6)
        assert y.shape == (5, 64) and rstd.shape == (5, 1)

    def f(x, g):
        y, _ = F._rms_norm_op(x, g, 1e-6)
        return F._silu_mul_op(y, y) * 2

    x, g = _r(4, 32), _r(32)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, g), f(x, g))


def test_modules_read_a_parametrized_weight():
    import npukern_torch
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    x = _r(3, 16)
    for cls, args in ((npukern_torch.RMSNorm, (x,)), (npukern_torch.AddRMSNorm, (x, _r(3, 16)))):
        m = cls(16, eps=1e-6)
        with torch.no_grad():
            m.weight.uniform_(0.5, 1.5)
        plain = m(*args)
        parametrize.register_parametrization(m, "weight", Double())
        with torch.no_grad():
            m.parametrizations.weight.original.mul_(0.5)  # the parametrized weight equals the old one
        got = m(*args)
        _same(got, plain)
        m.parametrizations.weight.original.data.mul_(2)
        assert not torch.equal((m(*args) if cls is npukern_torch.RMSNorm else m(*args)[0]),
                               plain if cls is npukern_torch.RMSNorm else plain[0])


def _general(m, *args):
    """The module's forward without its eager C call (the path it takes for
    anything that call does not)."""
    import npukern_torch.modules as mod

    saved = mod._rms_norm_module, mod._add_rms_norm_module
    mod._rms_norm_module = mod._add_rms_norm_module = None
    try:
        return m(*args)
    finally:
        mod._rms_norm_module, mod._add_rms_norm_module = saved


@pytest.mark.parametrize("casting", ["torch", "llama", "gemma"])
@pytest.mark.parametrize("xd,wd", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                   (torch.float16, torch.float32), (torch.float32, torch.float32),
                                   (torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16)])
def test_module_eager_call_is_the_general_path(casting, xd, wd):
    """RMSNorm / AddRMSNorm's eager C call (csrc/fast_call.cpp) against the
    module's general path: the same bits, dtypes and gradients for every
    dtype pair and casting mode, including those the C call hands back."""
    import npukern_torch
    import npukern_torch.modules as mod

    assert mod._rms_norm_module is not None
    for affine in (True, False):
        for cls in (npukern_torch.RMSNorm, npukern_torch.AddRMSNorm):
            m = cls(24, eps=None if affine else 1e-5, elementwise_affine=affine, dtype=wd, casting=casting)
            if affine:
                with torch.no_grad():
                    m.weight.uniform_(0.5, 1.5)
            x, r = _r(3, 24, dtype=xd), _r(3, 24, dtype=xd)
            args = (x,) if cls is npukern_torch.RMSNorm else (x, r)
            try:
                want = _general(m, *args)
            except Exception as e:  # then the eager call raises the same
                with pytest.raises(type(e)) as got:
                    m(*args)
                assert str(got.value) == str(e)
                continue
            _same(m(*args), want)
            xa = tuple(a.detach().clone().requires_grad_() for a in args)
            xb = tuple(a.detach().clone().requires_grad_() for a in args)
            out_a, out_b = m(*xa), _general(m, *xb)
            _same(out_a, out_b)
            ya = out_a if cls is npukern_torch.RMSNorm else out_a[0]
            yb = out_b if cls is npukern_torch.RMSNorm else out_b[0]
            ga = torch.autograd.grad(ya.float().square().sum(), xa + ((m.weight,) if affine else ()))
            gb = torch.autograd.grad(yb.float().square().sum(), xb + ((m.weight,) if affine else ()))
            for a, b in zip(ga, gb):
                _same(a, b)


def test_module_eager_call_leaves_the_rest_to_the_module():
    """Subclasses, __torch_function__ modes, hooks, fake tensors, float64 and
    mismatched residuals still reach the module's own handling."""
    import npukern_torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    m = npukern_torch.RMSNorm(8, eps=1e-6)
    x = _r(2, 8)
    _Logged.seen.clear()
    m(x.as_subclass(_Logged))
    assert ops.rms_norm.default in _Logged.seen

    class Mode(TorchFunctionMode):
        seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Mode.seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        m(x)
    assert ops.rms_norm.default in Mode.seen
    calls = []
    h = m.register_forward_hook(lambda mod, a, out: calls.append(out))
    y = m(x)
    h.remove()
    assert len(calls) == 1 and calls[0] is y
    with FakeTensorMode():
        assert npukern_torch.RMSNorm(8)(torch.empty(5, 8)).shape == (5, 8)
    x64 = _r(2, 8).double()
    assert m.double()(x64).dtype == torch.float64
    am = npukern_torch.AddRMSNorm(8, eps=1e-6)
    y, s = am(_r(2, 8), _r(8))  # broadcast residual: torch adds first
    assert s.shape == (2, 8)
    with pytest.raises(Exception):
        m.float()(_r(2, 7))  # a wrong shape is the op's own error
