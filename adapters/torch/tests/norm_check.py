"""The float64 judge for the norm ops: torch's own composite RMSNorm in
float64, differentiated with torch.autograd.grad, and the per-dtype bars.

Bars (the kernel computes in f32 and rounds each output once):
- y: <= 1 ulp of x's dtype for float16/bfloat16; 2e-6 relative for float32.
- rstd: 1e-6 relative.
- dx: |dx - ref| <= 1 ulp(ref) + 1e-5 * rstd * (|g| + |xh| * mean|g * xh|)
  elementwise (g = dy * gamma, xh = x * rstd): the second term is the f32
  error of the row reduction mean(g * xh), which cancels.
- dgamma: |dgamma - ref| <= 1e-5 * sum over rows |dy * xh| (f32 column sums).
NaN must appear exactly where the float64 composite has NaN.
"""

import torch

from conftest import HALF, record, ulp, ulps

ops = torch.ops.npukern


def f32(v: float) -> float:
    """v as the f32 the kernel adds (eps)."""
    return float(torch.tensor(v, dtype=torch.float32))


def norm_dims(x, gamma):
    return tuple(range(x.dim() - gamma.dim(), x.dim()))


def reference(x, gamma, eps, dy, dres=None):
    """(y, rstd, dx, dgamma) of torch's composite in float64, from the same
    (rounded) inputs."""
    x64 = x.detach().double().requires_grad_()
    g64 = gamma.detach().double().requires_grad_()
    dims = norm_dims(x, gamma)
    rstd = torch.rsqrt(x64.pow(2).mean(dims, keepdim=True) + f32(eps))
    y = x64 * rstd * g64
    dx, dg = torch.autograd.grad(y, (x64, g64), dy.double())
    if dres is not None:
        dx = dx + dres.double()
    return y.detach(), rstd.detach(), dx, dg


def _same_nans(got, ref, what):
    assert torch.equal(got.isnan(), ref.isnan()), f"{what}: NaN pattern differs from float64"


def check_forward(y, rstd, x, gamma, y64, r64, label):
    dims = norm_dims(x, gamma)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == r64.shape
    _same_nans(y, y64, "y")
    _same_nans(rstd, r64, "rstd")
    if x.dtype in HALF:
        worst = ulps(y, y64).nan_to_num(0).max().item() if y.numel() else 0.0
        record(f"y ulps ({x.dtype}) {label}", worst)
        assert worst <= 1.0, f"y off by {worst} ulp"
    else:
        rel = _rel(y, y64)
        record(f"y rel (float32) {label}", rel)
        assert rel <= 2e-6, f"y relative error {rel}"
    rel = _rel(rstd, r64)
    record(f"rstd rel {label}", rel)
    assert rel <= 1e-6, f"rstd relative error {rel}"
    del dims


def check_dx(dx, x, gamma, dy, r64, dx64, label):
    """dx against the float64 gradient; returns the float64 column sums
    of |dy * xh| over these rows (dgamma's bar)."""
    dims = norm_dims(x, gamma)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    _same_nans(dx, dx64, "dx")
    x64, dy64, g64 = x.double(), dy.double(), gamma.double()
    xh = x64 * r64
    g = dy64 * g64
    c_abs = (g * xh).abs().mean(dims, keepdim=True)
    bar = ulp(dx64, dx.dtype) + 1e-5 * r64 * (g.abs() + xh.abs() * c_abs)
    score = _score(dx, dx64, bar)
    record(f"dx score ({x.dtype}) {label}", score)
    assert score <= 1.0, f"dx score {score} (1 = the bar)"
    rows = tuple(range(x.dim() - gamma.dim()))
    return (dy64 * xh).abs().sum(rows) if rows else (dy64 * xh).abs()


def check_dgamma(dg, gamma, dg64, abs_sum, label):
    assert dg.dtype == torch.float32 and dg.shape == gamma.shape
    _same_nans(dg, dg64, "dgamma")
    dg_score = _score(dg, dg64, 1e-5 * abs_sum + 1e-300)
    record(f"dgamma score ({gamma.dtype} gamma) {label}", dg_score)
    assert dg_score <= 1.0, f"dgamma score {dg_score}"


def check_backward(dx, dg, x, gamma, dy, r64, dx64, dg64, label):
    check_dgamma(dg, gamma, dg64, check_dx(dx, x, gamma, dy, r64, dx64, label), label)


def check_all(x, gamma, eps, dy, label="", chunk=1 << 21):
    """Runs the ops and checks every output against the float64 composite,
    a slab of about `chunk` elements at a time (rows are independent; the
    dgamma reference and bar are summed over the slabs)."""
    y, rstd = ops.rms_norm(x, gamma, eps)
    dx, dg = ops.rms_norm_backward(dy, x, gamma, rstd)
    lead = x.shape[: x.dim() - gamma.dim()]
    assert rstd.shape == (*lead, *([1] * gamma.dim()))
    as_rows = (-1, *gamma.shape)
    x2, dy2, y2, dx2 = (t.reshape(as_rows) for t in (x, dy, y, dx))
    r2 = rstd.reshape(-1, *([1] * gamma.dim()))
    step = max(1, chunk // max(1, gamma.numel()))
    dg64 = torch.zeros(gamma.shape, dtype=torch.float64)
    abs_sum = torch.zeros(gamma.shape, dtype=torch.float64)
    for r0 in range(0, x2.shape[0], step):
        rows = slice(r0, r0 + step)
        y64, r64, dx64, dg_part = reference(x2[rows], gamma, eps, dy2[rows])
        check_forward(y2[rows], r2[rows], x2[rows], gamma, y64, r64, label)
        abs_sum += check_dx(dx2[rows], x2[rows], gamma, dy2[rows], r64, dx64, label)
        dg64 += dg_part
    check_dgamma(dg, gamma, dg64, abs_sum, label)


def _nonfinite_agree(g, r):
    """Where the reference is +-Inf the output must be the same infinity
    (NaN positions are compared separately)."""
    inf = r.isinf()
    assert torch.equal(g[inf], r[inf]), "an infinity of the float64 composite is not reproduced"


def _rel(got, ref):
    return _score(got, ref, ref.double().abs().clamp_min(1e-300))


def _score(got, ref, bar):
    """max |got - ref| / bar over the positions where ref is finite (an
    output that is not finite there scores inf)."""
    g, r = got.double(), ref.double()
    _nonfinite_agree(g, r)
    keep = r.isfinite()
    if not keep.any():
        return 0.0
    return ((g - r).abs()[keep] / bar[keep]).max().item()
