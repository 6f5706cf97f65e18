"""npukern_torch.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on
mixed-dtype parameter lists, with NaN and Inf.

Bars: the total norm within 3e-8 relative of the float64 norm of the same
values (npukern rounds each square to f32, <= 2^-24 relative, and sums them in
f64; the square root halves that); torch's own norm within the accuracy of
its lowest-precision dtype (it rounds each tensor's norm to the tensor's
dtype: 2^-8 relative for bfloat16); clipped gradients within 1 ulp of
g * min(1, max_norm / (norm + 1e-6)) computed in float64 (npukern computes the
coefficient in f64 and rounds it once to float32, then each element once)."""

import pytest
import torch

import npukern_torch
from conftest import rand, record, same_bits, ulps

SPECS = [((4, 5), torch.float32), ((3, 7), torch.bfloat16), ((10, 10, 10), torch.float16), ((), torch.float32),
         ((0, 3), torch.float32), ((2049,), torch.bfloat16), ((33, 65), torch.float32)]


def make_params(gen, scale=1.0, specs=SPECS):
    params = []
    for shape, dtype in specs:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        p.grad = rand(shape, dtype, -scale, scale, gen=gen)
        params.append(p)
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: skipped
    return params


def clone_params(params):
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


def norm64(params):
    return torch.cat([p.grad.double().reshape(-1) for p in params if p.grad is not None]).norm().item()


@pytest.mark.parametrize("max_norm", [1.0, 1e9], ids=["active", "inactive"])
def test_matches_torch(max_norm, gen):
    params = make_params(gen, scale=3.0)
    theirs = clone_params(params)
    exact = norm64(params)
    total = npukern_torch.clip_grad_norm_(params, max_norm)
    total_torch = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert total.dtype == total_torch.dtype and total.shape == total_torch.shape == ()
    # The op returns the f64 norm; the wrapper rounds it to torch's dtype.
    grads = [p.grad for p in make_params(gen.manual_seed(20261123), scale=3.0) if p.grad is not None]
    total64 = torch.ops.npukern.clip_grad_norm_([g.clone() for g in grads], 1e30).item()
    rel = abs(total64 - exact) / exact
    record("clip total norm rel err vs float64", rel)
    assert rel <= 3e-8
    torch_rel = abs(total_torch.item() - exact) / exact
    record("torch's own clip total norm rel err vs float64 (bf16 in the list)", torch_rel)
    assert torch_rel <= 2.0**-8 and abs(total.item() - exact) <= 2.0**-24 * exact
    coef = min(1.0, max_norm / (exact + 1e-6))
    for p, q, g in zip(params, theirs, grads + [None]):
        if p.grad is None:
            assert q.grad is None
            continue
        if max_norm > exact:
            assert torch.equal(p.grad, q.grad) and torch.equal(p.grad, g), "an inactive clip changed a gradient"
        worst = ulps(p.grad, g.double() * coef).max().item() if p.grad.numel() else 0.0
        record(f"clipped grad ulps vs float64 ({p.dtype})", worst)
        assert worst <= 1.0


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_nonfinite(bad, gen):
    params = make_params(gen)
    params[1].grad[1, 2] = float(bad)
    before = [p.grad.clone() if p.grad is not None else None for p in params]
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        npukern_torch.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    for p, b in zip(params, before):
        assert b is None or same_bits(p.grad, b), "error_if_nonfinite changed a gradient"
    theirs = clone_params(params)
    total = npukern_torch.clip_grad_norm_(params, 1.0)
    total_torch = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
    assert torch.equal(total.isnan(), total_torch.isnan()) and torch.equal(total.isinf(), total_torch.isinf())
    for p, q in zip(params, theirs):
        if p.grad is not None:
            # NaN: everything NaN. Inf: coefficient 0, so 0 and NaN (= Inf * 0), as torch.
            assert torch.equal(p.grad.isnan(), q.grad.isnan())
            assert torch.equal(p.grad.nan_to_num(), q.grad.nan_to_num())


def test_forms_and_fallbacks(gen):
    assert npukern_torch.clip_grad_norm_([], 1.0).item() == 0.0
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert npukern_torch.clip_grad_norm_(p, 10.0).item() == 5.0  # a single tensor
    # Other norm types and float64 gradients go to torch's own function.
    params = make_params(gen, specs=[((5,), torch.float64), ((3,), torch.float32)])
    theirs = clone_params(params)
    for norm_type in (float("inf"), 1.0, 2.0):
        a = npukern_torch.clip_grad_norm_(params, 0.5, norm_type=norm_type)
        b = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type=norm_type)
        assert torch.equal(a, b)
        assert all(torch.equal(x.grad, y.grad) for x, y in zip(params[:2], theirs[:2]))


def test_non_contiguous_gradient_is_clipped_in_place(gen):
    p = torch.nn.Parameter(torch.zeros(8, 6))
    p.grad = rand((6, 8), torch.float32, gen=gen).t()
    storage = p.grad.data_ptr()
    expect = p.grad.clone()
    total = npukern_torch.clip_grad_norm_([p], 0.1)
    assert p.grad.data_ptr() == storage and not p.grad.is_contiguous()
    coef = torch.tensor(min(1.0, 0.1 / (total.item() + 1e-6)), dtype=torch.float32)
    assert ulps(p.grad, (expect * coef).double()).max() <= 1.0


def test_bad_max_norm_is_refused(gen):
    params = make_params(gen)
    with pytest.raises(ValueError):
        npukern_torch.clip_grad_norm_(params, -1.0)
    with pytest.raises(ValueError):
        npukern_torch.clip_grad_norm_(params, float("nan"))


def test_grad_stats(gen):
    grads = [rand((7, 9), torch.bfloat16, gen=gen), rand((100,), torch.float32, gen=gen)]
    grads[1][5] = float("nan")
    grads[1][6] = float("-inf")
    s = torch.ops.npukern.grad_stats(grads)
    finite = torch.cat([g.double().reshape(-1) for g in grads])
    finite = finite[finite.isfinite()]
    assert abs(s[0].item() - finite.pow(2).sum().item()) <= 2.0**-24 * s[0].item()  # f32 squares
    assert s[1].item() == 1 and s[2].item() == 1
    assert s[3].item() == finite.min().item() and s[4].item() == finite.max().item()
    assert s[5].item() == finite.abs().max().item()


@pytest.mark.parametrize(
    "norm_type,dtype", [(1.0, torch.float32), (float("inf"), torch.float32), (2.0, torch.float64)],
    ids=["l1", "linf", "float64"],
)
def test_generator_reaches_torch_hand_off(norm_type, dtype, gen):
    """Review defect 1: `clip_grad_norm_(model.parameters(), ...)` on a path
    handed to torch (norm_type != 2, float64 gradients) must clip: the
    generator is read once, not once for the check and again for torch."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)).to(dtype)
    model(rand((5, 8), torch.float32, -3, 3, gen=gen).to(dtype)).square().sum().mul(100).backward()
    twin = [p.grad.clone() for p in model.parameters()]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    for p, g in zip(theirs, twin):
        p.grad = g
    total = npukern_torch.clip_grad_norm_(model.parameters(), 0.5, norm_type=norm_type)
    total_torch = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type=norm_type)
    assert total.item() > 0.5 and total.item() == total_torch.item()
    for p, q in zip(model.parameters(), theirs):
        assert torch.equal(p.grad, q.grad)
