"""Shared helpers: units of error against float64, and a record of the
largest measured differences, printed at the end of the run."""

import os

# The Hugging Face tests build their models from configs: nothing may download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import npukern_torch  # noqa: F401  (registers torch.ops.npukern)

HALF = (torch.float16, torch.bfloat16)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MANTISSA = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}
_MIN_EXP = {torch.float32: -126, torch.float16: -14, torch.bfloat16: -126}

# name -> largest value seen (the closing note quotes these).
WORST = {}


def record(name, value):
    """Keeps the largest `value` measured under `name`."""
    value = float(value)
    if name not in WORST or value > WORST[name]:
        WORST[name] = value


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` at each (float64) reference value: one unit in
    the last place, subnormals included."""
    _, e = torch.frexp(ref.abs().to(torch.float64))  # |ref| = m * 2**e, m in [0.5, 1)
    e = torch.clamp(e - 1, min=_MIN_EXP[dtype])
    return torch.ldexp(torch.ones_like(ref, dtype=torch.float64), e - _MANTISSA[dtype])


def ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got - ref| in units of got's dtype at ref (NaN where both are NaN or equal infinities count as 0)."""
    g, r = got.to(torch.float64), ref.to(torch.float64)
    same = (g == r) | (g.isnan() & r.isnan())
    d = (g - r).abs() / ulp(r, got.dtype)
    return torch.where(same, torch.zeros_like(d), d)


def rand(shape, dtype, lo=-2.0, hi=2.0, gen=None):
    """Uniform values in [lo, hi), rounded to `dtype`."""
    t = torch.rand(shape, dtype=torch.float64, generator=gen) * (hi - lo) + lo
    return t.to(dtype)


def pytest_configure(config):
    # scripts/torch_test.sh's second run (the pinned transformers + kernels)
    # deselects these: tests in a version-dependent file that use torch
    # alone, which the first run already covers.
    config.addinivalue_line("markers", "torch_only: depends on torch alone, not on transformers or kernels")


def pytest_terminal_summary(terminalreporter):
    if not WORST:
        return
    terminalreporter.section("npukern_torch: largest differences measured")
    for name in sorted(WORST):
        terminalreporter.write_line(f"{name:60s} {WORST[name]:.3g}")


@pytest.fixture(autouse=True)
def _seeded_global_rng():
    """Tests that draw from torch's global generator get the same data
    whatever ran before them (the skipped set differs between transformers
    versions, and with it the generator's state)."""
    torch.manual_seed(20261127)


@pytest.fixture
def gen():
    """A seeded generator: every test's data is fixed."""
    return torch.Generator().manual_seed(20261123)


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def backward_compiled_and_eager(grads):
    """`grads(backward)` run twice: once with `backward(loss)` under compiled
    autograd (torch.compile's eager backend), once plain; both results."""
    from torch._dynamo import compiled_autograd

    def compiled(loss):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            loss.backward()

    return grads(compiled), grads(lambda loss: loss.backward())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads included) of same-dtype tensors."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = _BITS[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def copied(obj, door):
    """`obj` through one of a user's copy doors: "deepcopy", "pickle" or
    "torch.save" (and torch.load back, weights_only=False)."""
    import copy
    import io
    import pickle

    if door == "deepcopy":
        return copy.deepcopy(obj)
    if door == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def bytes_per_param(params, opt):
    """Bytes a parameter holds, counted from the tensors: param, grad and
    every state tensor of `opt` but the step count."""
    n = sum(p.numel() for p in params)
    total = sum(2 * p.numel() * p.element_size() for p in params)  # param and grad
    for p in params:
        total += sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "step")
    return total / n
