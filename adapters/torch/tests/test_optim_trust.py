"""The optimizer's doors (issue 58): aliasing through strided views, state
through deepcopy / pickle / torch.save and through torch's AdamW and back,
Adam's decoupled_weight_decay, torch_npu's beta powers as callers pass
them, parameters torch's AdamW takes (complex, float64, > 8 dims), and
errors raised before anything is written (every group checked first; step
counts unmoved). Each test failed on the code before its fix."""

import math

import pytest
import torch

from conftest import copied
from npukern_torch import npu
from npukern_torch.optim import Adam, AdamW


def _params(dtype=torch.float32, seed=0, shapes=((5, 7), (13,))):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g).to(dtype)) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    return ps


# 1. Aliasing through strided views.

def test_strided_outputs_that_alias_are_refused_before_any_write():
    var, grad = torch.randn(8), torch.randn(8)
    buf = torch.zeros(16)
    before = (var.clone(), buf.clone())
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] and exp_avg_sqs\[0\] share memory|share memory"):
        npu.npu_apply_adam_w(1.0, 1.0, 1e-3, 0.01, 0.9, 0.999, 1e-8, grad, out=(var, buf[::2], buf[::2]))
    assert torch.equal(var, before[0]) and torch.equal(buf, before[1])


def test_one_strided_param_listed_twice_is_refused():
    base = torch.randn(4, 6)
    a, b = torch.nn.Parameter(base.t()), torch.nn.Parameter(base.t())
    a.grad, b.grad = torch.ones(6, 4), torch.ones(6, 4)
    opt = AdamW([a, b], lr=0.1)
    keep = base.clone()
    with pytest.raises(ValueError, match=r"params\[0\] and params\[1\] share memory"):
        opt.step()
    assert torch.equal(base, keep)
    assert all(float(s["step"]) == 0.0 for s in opt.state.values())


@pytest.mark.parametrize("where", ["two groups", "two dtype buckets"])
def test_params_over_one_base_in_two_kernel_calls_are_refused_before_any_write(where):
    # Each call of the kernel checks its own lists; two groups (or a float32
    # and a bfloat16 bucket of one group) are two calls, so the optimizer
    # checks across them before the first.
    base = torch.randn(4, 6)
    a = torch.nn.Parameter(base.t())
    if where == "two groups":
        b = torch.nn.Parameter(base.t())
        groups = [{"params": [a]}, {"params": [b], "lr": 0.1}]
    else:
        b = torch.nn.Parameter(base.view(torch.bfloat16))  # the same bytes, another dtype
        groups = [{"params": [a, b]}]
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt = AdamW(groups, lr=0.1)
    keep = base.clone()
    with pytest.raises(ValueError, match=r"param of shape .* in group 0 and the param of shape .* share memory"):
        opt.step()
    assert torch.equal(base, keep)
    assert all(float(s["step"]) == 0.0 for s in opt.state.values())


def test_disjoint_views_of_one_base_in_two_groups_step_as_separate_tensors():
    base = torch.randn(4, 6)
    a, b = torch.nn.Parameter(base[:2]), torch.nn.Parameter(base[2:])
    a2, b2 = torch.nn.Parameter(base[:2].clone()), torch.nn.Parameter(base[2:].clone())
    for p in (a, b, a2, b2):
        p.grad = torch.full_like(p, 0.5)
    AdamW([{"params": [a]}, {"params": [b], "lr": 0.1}]).step()
    AdamW([{"params": [a2]}, {"params": [b2], "lr": 0.1}]).step()
    assert torch.equal(base[:2], a2) and torch.equal(base[2:], b2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("master_weights", [False, True])
def test_meta_params_step_as_torchs_adamw_steps_them(dtype, master_weights):
    # torch's AdamW takes meta params (a dry run of shapes, deferred init);
    # this refused them as not on the CPU.
    p = torch.nn.Parameter(torch.empty(3, 4, device="meta", dtype=dtype))
    p.grad = torch.empty(3, 4, device="meta", dtype=dtype)
    ref = torch.nn.Parameter(torch.empty(3, 4, device="meta", dtype=dtype))
    ref.grad = torch.empty(3, 4, device="meta", dtype=dtype)
    opt = AdamW([p], master_weights=master_weights, max_grad_norm=1.0)
    theirs = torch.optim.AdamW([ref])
    for _ in range(2):
        opt.step()
        theirs.step()
    assert p.is_meta and float(opt.state[p]["step"]) == float(theirs.state[ref]["step"]) == 2.0
    assert opt.state[p]["exp_avg"].is_meta and opt.state[p]["exp_avg"].shape == p.shape


def test_an_output_that_overlaps_itself_is_refused_before_m_and_v_change():
    var, grad, m, v = torch.randn(4), torch.randn(4), torch.zeros(4), torch.zeros(4)
    with pytest.raises(ValueError, match="overlaps itself"):
        npu.npu_apply_fused_adamw_v2(var, grad, m, v, torch.zeros(1).expand(4), 1, amsgrad=True)
    with pytest.raises(ValueError, match="overlaps itself"):
        npu.npu_apply_adam_w(1.0, 1.0, 1e-3, 0.0, 0.9, 0.999, 1e-8, grad, out=(torch.zeros(1).expand(4), m, v))
    assert not m.any() and not v.any()


def test_shapes_must_match_not_only_counts():
    var = torch.randn(2, 3)
    with pytest.raises(ValueError, match="grad has shape"):
        npu.npu_apply_adam_w(1.0, 1.0, 1e-3, 0.0, 0.9, 0.999, 1e-8, torch.randn(3, 2),
                             out=(var, torch.zeros(2, 3), torch.zeros(2, 3)))
    with pytest.raises(ValueError, match="exp_avg has shape"):
        npu.npu_apply_fused_adamw_v2(var, torch.randn(2, 3), torch.zeros(3, 2), torch.zeros(2, 3), None, 1)


# 2. State through its doors.

@pytest.mark.parametrize("door", ["deepcopy", "pickle", "torch.save"])
def test_state_survives_copies(door):
    ps = _params(torch.bfloat16)
    opt = AdamW(ps, lr=1e-2, master_weights=True, max_grad_norm=1.0)
    opt.step()
    twin = copied(opt, door)
    assert twin.master_weights is True and twin.max_grad_norm == 1.0
    assert torch.equal(twin.grad_norm, opt.grad_norm)
    tp = [p for g in twin.param_groups for p in g["params"]]
    for p in tp:
        p.grad = torch.ones_like(p)
    twin.step()  # raised AttributeError before
    # The load hooks came along: a state dict keeps its float32 masters.
    twin.load_state_dict(opt.state_dict())
    assert all(twin.state[p]["master"].dtype == torch.float32 for p in tp)


def test_masters_through_torch_adamw_and_back():
    ps = _params(torch.bfloat16, seed=1)
    ours = AdamW(ps, lr=1e-2, master_weights=True)
    ours.step()
    theirs = torch.optim.AdamW(ps, lr=1e-2)
    theirs.load_state_dict(ours.state_dict())  # torch casts the master to bf16
    back = AdamW(ps, lr=1e-2, master_weights=True)
    back.load_state_dict(theirs.state_dict())
    for p in ps:
        st = back.state[p]
        assert all(st[n].dtype == torch.float32 for n in ("master", "exp_avg", "exp_avg_sq"))
    back.step()  # raised "masters: dtype bf16: want f32" before
    assert all(float(back.state[p]["step"]) == 2.0 for p in ps)
    # torch's own bf16 state into master_weights=True: float32 moments too.
    fresh = _params(torch.bfloat16, seed=2)
    t = torch.optim.AdamW(fresh, lr=1e-2)
    t.step()
    o = AdamW(fresh, lr=1e-2, master_weights=True)
    o.load_state_dict(t.state_dict())
    assert all(o.state[p]["exp_avg"].dtype == torch.float32 for p in fresh)


def test_adam_takes_decoupled_weight_decay_and_a_torch_adamw_state():
    ref = _params(seed=3)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    for a, b in zip(ours, ref):
        a.grad = b.grad.clone()
    torch.optim.Adam(ref, lr=0.1, weight_decay=0.5, decoupled_weight_decay=True).step()
    Adam(ours, lr=0.1, weight_decay=0.5, decoupled_weight_decay=True).step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # A torch AdamW state dict into npukern's Adam: the group's decoupled decay rules.
    ref2 = _params(seed=4)
    ours2 = [torch.nn.Parameter(p.detach().clone()) for p in ref2]
    for a, b in zip(ours2, ref2):
        a.grad = b.grad.clone()
    t = torch.optim.AdamW(ref2, lr=0.1, weight_decay=0.5)
    o = Adam(ours2, lr=0.1, weight_decay=0.5)
    o.load_state_dict(t.state_dict())
    t.step()
    o.step()
    for a, b in zip(ours2, ref2):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# 3. Valid input that crashed.

@pytest.mark.parametrize("form", ["float64", "float32", "beta1_zero"])
def test_beta_powers_as_callers_pass_them(form):
    beta1, beta2 = (0.0, 0.999) if form == "beta1_zero" else (0.9, 0.999)
    var, m, v = torch.randn(6), torch.zeros(6), torch.zeros(6)
    ref = [var.clone(), m.clone(), v.clone()]
    for step in list(range(1, 50)) + [7199, 7300]:
        grad = torch.randn(6, generator=torch.Generator().manual_seed(step))
        if form == "float32":
            p1 = float(torch.tensor(beta1, dtype=torch.float32) ** torch.tensor(step - 1.0))
            p2 = float(torch.tensor(beta2, dtype=torch.float32) ** torch.tensor(step - 1.0))
        else:
            p1, p2 = beta1 ** (step - 1), beta2 ** (step - 1)
        npu.npu_apply_adam_w(p1, p2, 1e-3, 0.0, beta1, beta2, 1e-8, grad, out=(var, m, v))
        # The same step through the optimizer's own kernel call, with the step given.
        torch.ops.npukern.adamw_([ref[0]], [grad], [ref[1]], [ref[2]], [], [], 1e-3, beta1, beta2, 1e-8, 0.0,
                                 step, 0, 0.0, 1.0, 0.0, 1.0, [], [], [])
        assert torch.equal(var, ref[0]), step
    assert math.isfinite(float(var.sum()))


def test_parameters_torch_adamw_takes():
    # complex (stepped as view_as_real), float64 (torch's own step), > 8 dims.
    g = torch.Generator().manual_seed(5)
    c = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.complex64, generator=g))
    d = torch.nn.Parameter(torch.randn(5, dtype=torch.float64, generator=g))
    h = torch.nn.Parameter(torch.randn(*([2] * 9), generator=g))
    for p in (c, d, h):
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in (c, d, h)]
    for a, b in zip(twins, (c, d, h)):
        a.grad = b.grad.clone()
    ours, theirs = AdamW([c, d, h], lr=0.01), torch.optim.AdamW(twins, lr=0.01)
    for _ in range(3):
        ours.step()
        theirs.step()
    for a, b in zip((c, d, h), twins):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tensor_lr_of_two_elements_is_a_value_error():
    with pytest.raises(ValueError, match="1-element"):
        AdamW(_params(), lr=torch.tensor([0.1, 0.2]))


# 4. Errors before writes.

def test_a_later_groups_error_leaves_every_group_unstepped():
    first, second = _params(seed=6), _params(seed=7)
    opt = AdamW([{"params": first}, {"params": second}], lr=0.1)
    opt.step()
    keep = [p.detach().clone() for p in first + second]
    steps = [float(opt.state[p]["step"]) for p in first + second]
    opt.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr"):
        opt.step()
    assert all(torch.equal(p, k) for p, k in zip(first + second, keep))
    assert [float(opt.state[p]["step"]) for p in first + second] == steps
    opt.param_groups[1]["lr"] = 0.1
    bad = torch.nn.Parameter(torch.zeros(3, dtype=torch.int32), requires_grad=False)
    bad.grad = torch.zeros(3, dtype=torch.int32)
    opt.param_groups[1]["params"].append(bad)
    with pytest.raises(TypeError):
        opt.step()
    assert all(torch.equal(p, k) for p, k in zip(first + second, keep))
    assert [float(opt.state[p]["step"]) for p in first + second] == steps


def test_load_state_dict_copies_no_state():
    # A resume's peak: torch's load copies nothing whose dtype matches; the
    # pre-hook cloned every state tensor (193 MiB for one 2^25-element param).
    p = torch.nn.Parameter(torch.randn(1 << 12, dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    opt = AdamW([p], master_weights=True)
    opt.step()
    sd = opt.state_dict()
    fresh = AdamW([p], master_weights=True)
    fresh.load_state_dict(sd)
    st, saved = fresh.state[p], sd["state"][0]
    for n in ("master", "exp_avg", "exp_avg_sq"):
        assert st[n].dtype == torch.float32
        assert st[n].data_ptr() == saved[n].data_ptr(), n  # the loaded tensor itself, not a copy
