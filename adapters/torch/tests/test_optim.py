"""npukern_torch.optim.AdamW / Adam against torch.optim's (fused) AdamW and
Adam: trajectories, param groups, LR schedulers, state_dict in both
directions, master weights, the clip inside the step, the non-finite skip."""

import copy
import math

import pytest
import torch

import npukern_torch
from npukern_torch.optim import Adam, AdamW


def net(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 130), torch.nn.GELU(), torch.nn.Linear(130, 7)).to(dtype)


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 64, generator=g), torch.randn(32, 7, generator=g)


def train(m, opt, steps, dtype=torch.float32, sched=None, clip=None):
    x, y = data()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x.to(dtype)).float(), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        if sched is not None:
            sched.step()


def max_diff(a, b):
    return max((p.float() - q.float()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_float32_tracks_torch_fused_adamw(amsgrad, maximize):
    a, b = net(), net()
    kw = dict(lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, maximize=maximize)
    train(a, AdamW(a.parameters(), **kw), 20)
    train(b, torch.optim.AdamW(b.parameters(), fused=True, **kw), 20)
    # Same formula in float32; torch's vector code may fuse multiply-adds.
    assert max_diff(a, b) < 1e-5


def test_adam_l2_groups_and_scheduler_track_torch():
    a, b = net(), net()

    def groups(m):
        return [
            {"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},
            {"params": [m[0].bias, m[2].bias], "weight_decay": 0.0, "lr": 3e-3},
        ]

    oa = Adam(groups(a), lr=1e-2)
    ob = torch.optim.Adam(groups(b), lr=1e-2, fused=True)
    train(a, oa, 12, sched=torch.optim.lr_scheduler.StepLR(oa, 3, 0.5))
    train(b, ob, 12, sched=torch.optim.lr_scheduler.StepLR(ob, 3, 0.5))
    assert max_diff(a, b) < 1e-5
    assert oa.param_groups[0]["lr"] == ob.param_groups[0]["lr"]


def test_tensor_lr_and_closure():
    a, b = net(), net()
    oa = AdamW(a.parameters(), lr=torch.tensor(1e-2))
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2)
    x, y = data()

    def closure(m, o):
        def f():
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss

        return f

    for _ in range(5):
        la = oa.step(closure(a, oa))
        lb = ob.step(closure(b, ob))
        assert torch.allclose(la, lb, rtol=1e-5)
    assert max_diff(a, b) < 1e-5


def test_state_dict_interchangeable_with_torch():
    a, b = net(), net()
    oa = AdamW(a.parameters(), lr=1e-2, amsgrad=True)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, amsgrad=True)
    train(a, oa, 3)
    train(b, ob, 3)
    # torch -> npukern, then both continue identically (a copy: torch's
    # loader keeps the given tensors, which both would then update).
    oa.load_state_dict(copy.deepcopy(ob.state_dict()))
    a.load_state_dict(b.state_dict())
    train(a, oa, 4)
    train(b, ob, 4)
    assert max_diff(a, b) < 1e-5
    # npukern -> torch.
    ob2 = torch.optim.AdamW(b.parameters(), lr=1e-2, amsgrad=True)
    ob2.load_state_dict(copy.deepcopy(oa.state_dict()))
    assert float(ob2.state[b[0].weight]["step"]) == 7.0


def test_master_weights_bf16():
    ref, m = net(), net(torch.bfloat16)
    o = AdamW(m.parameters(), lr=1e-3, master_weights=True)
    train(m, o, 5, dtype=torch.bfloat16)
    for p in m.parameters():
        st = o.state[p]
        assert st["master"].dtype == torch.float32 and st["exp_avg"].dtype == torch.float32
        assert torch.equal(p, st["master"].to(torch.bfloat16)), "the param is its master rounded once"
    # Updates below bf16's step accumulate in the master (stock bf16 AdamW
    # loses them): after 5 steps of lr 1e-3 masters have moved off the grid.
    moved = sum(int((o.state[p]["master"] != o.state[p]["master"].bfloat16().float()).sum()) for p in m.parameters())
    assert moved > 0
    # The float32 state survives a state_dict round trip (torch's loader
    # would cast it to bf16).
    o2 = AdamW(m.parameters(), lr=1e-3, master_weights=True)
    o2.load_state_dict(o.state_dict())
    for p in m.parameters():
        assert o2.state[p]["master"].dtype == torch.float32
        assert torch.equal(o2.state[p]["master"], o.state[p]["master"])
    del ref


def test_max_grad_norm_is_torch_clip_then_step():
    a, b = net(), net()
    oa = AdamW(a.parameters(), lr=1e-2, max_grad_norm=0.05)
    ob = torch.optim.AdamW(b.parameters(), lr=1e-2, fused=True)
    train(a, oa, 10)
    train(b, ob, 10, clip=0.05)
    assert max_diff(a, b) < 1e-5
    x, y = data()
    b.zero_grad()
    torch.nn.functional.mse_loss(b(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(b.parameters(), float("inf"))
    oa.zero_grad()
    torch.nn.functional.mse_loss(a(x), y).backward()
    oa.step()
    assert oa.grad_norm.dtype == torch.float32
    assert torch.allclose(oa.grad_norm, want, rtol=1e-4)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_norm_skips_the_step(bad):
    m = net(torch.bfloat16)
    o = AdamW(m.parameters(), lr=1e-3, master_weights=True, max_grad_norm=1.0)
    train(m, o, 2, dtype=torch.bfloat16)
    before = copy.deepcopy((list(m.parameters()), o.state_dict()))
    x, y = data()
    o.zero_grad()
    torch.nn.functional.mse_loss(m(x.bfloat16()).float(), y).backward()
    m[0].weight.grad[3, 5] = bad
    o.step()
    assert not torch.isfinite(o.grad_norm)
    for p, q in zip(m.parameters(), before[0]):
        assert torch.equal(p, q)
    st = o.state_dict()["state"]
    for k, s in before[1]["state"].items():
        for n, t in s.items():
            assert torch.equal(st[k][n], t), n


def test_bad_arguments():
    m = net()
    with pytest.raises(ValueError):
        AdamW(m.parameters(), lr=-1.0)
    with pytest.raises(ValueError):
        AdamW(m.parameters(), betas=(1.0, 0.9))
    with pytest.raises(ValueError):
        AdamW(m.parameters(), max_grad_norm=-1.0)
    with pytest.raises(ValueError):
        AdamW(m.parameters(), capturable=True)
    # float64 steps (torch's own step: test_optim_trust.py); integer params do not.
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.int32), requires_grad=False)
    p.grad = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(TypeError):
        AdamW([p]).step()


def test_op_errors_change_nothing():
    p = torch.randn(10)
    g = torch.randn(9)
    m, v = torch.zeros(10), torch.zeros(10)
    before = p.clone()
    with pytest.raises(Exception, match="grads"):
        torch.ops.npukern.adamw_([p], [g], [m], [v], [], [], 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 0, 0.0, 1.0, 0.0, 1.0, [], [],
                                 [])
    assert torch.equal(p, before)
    assert npukern_torch.optim.AdamW is AdamW


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_npu_apply_adam_w_is_torch_npus(amsgrad, maximize):
    from npukern_torch.npu import npu_apply_adam_w

    g = torch.Generator().manual_seed(3)
    var = torch.randn(1000, generator=g)
    m = torch.randn(1000, generator=g) * 1e-2
    v = torch.rand(1000, generator=g) * 1e-4
    grad = torch.randn(1000, generator=g) * 1e-2
    mx = torch.rand(1000, generator=g) * 1e-4
    b1, b2, lr, wd, eps, t = 0.9, 0.999, 1e-3, 0.01, 1e-8, 5
    b1p, b2p = b1 ** (t - 1), b2 ** (t - 1)
    # torch_npu's own CPU formula (op-plugin's test_apply_adam_w), in float64.
    d = [x.double() for x in (var, m, v, grad, mx)]
    gt = -d[3] if maximize else d[3]
    m_out = d[1] * b1 + (1 - b1) * gt
    v_out = d[2] * b2 + (1 - b2) * gt * gt
    var_t = d[0] * (1 - lr * wd)
    b1o, b2o = b1p * b1, b2p * b2
    mx_out = torch.maximum(d[4], v_out) if amsgrad else v_out
    want = var_t - lr * m_out / (1 - b1o) / (torch.sqrt(mx_out / (1 - b2o)) + eps)
    out = npu_apply_adam_w(b1p, b2p, lr, wd, b1, b2, eps, grad, mx if amsgrad else None, amsgrad, maximize,
                           out=(var, m, v))
    assert out[0] is var
    assert torch.allclose(var.double(), want, rtol=0, atol=1e-6 * lr + 2e-7 * want.abs().max().item())
    # float32 arithmetic: a few roundings of the terms' magnitudes.
    ulp = 2.0**-22
    assert ((m.double() - m_out).abs() <= ulp * ((d[1] * b1).abs() + ((1 - b1) * gt).abs())).all()
    assert ((v.double() - v_out).abs() <= ulp * ((d[2] * b2).abs() + (1 - b2) * gt * gt)).all()
    if amsgrad:
        assert ((mx.double() - mx_out).abs() <= ulp * mx_out.abs()).all()
    with pytest.raises(ValueError):
        npu_apply_adam_w(0.5, b2p, lr, wd, b1, b2, eps, grad, None, False, False, out=(var, m, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_npu_apply_fused_adamw_v2_is_mindspeeds(dtype, amsgrad):
    from npukern_torch.npu import npu_apply_adam_w, npu_apply_fused_adamw_v2

    g = torch.Generator().manual_seed(5)
    var = torch.randn(1000, generator=g).to(dtype)
    m = (torch.randn(1000, generator=g) * 1e-2).to(dtype)
    v = (torch.rand(1000, generator=g) * 1e-4).to(dtype)
    grad = torch.randn(1000, generator=g) * 1e-2  # float32 beside 16-bit params: MindSpeed's combinations
    mx = torch.rand(1000, generator=g) * 1e-4  # float32 max beside bf16 moments: updated through bf16
    b1, b2, lr, wd, eps, t = 0.9, 0.999, 1e-3, 0.01, 1e-8, 7
    # MindSpeed's documented reference (docs/ops/npu_apply_fused_adamw_v2.md) in float64.
    d = [x.double() for x in (var, m, v, grad, mx)]
    m_out = d[1] + (d[3] - d[1]) * (1 - b1)
    v_out = d[2] * b2 + d[3] * d[3] * (1 - b2)
    mx_out = torch.maximum(d[4], v_out) if amsgrad else v_out
    want = d[0] * (1 - lr * wd) - lr / (1 - b1**t) * m_out / (mx_out.sqrt() / math.sqrt(1 - b2**t) + eps)
    # The same step through torch_npu's name (previous step's powers): the same op, so the same bits.
    same = [x.clone() for x in (var, m, v, mx.to(dtype))]
    npu_apply_adam_w(b1 ** (t - 1), b2 ** (t - 1), lr, wd, b1, b2, eps, grad.to(dtype) if dtype != torch.float32
                     else grad, same[3] if amsgrad else None, amsgrad, False, out=tuple(same[:3]))
    step = torch.full((1,), t, dtype=torch.int64)
    assert npu_apply_fused_adamw_v2(var, grad, m, v, mx if amsgrad else None, step, lr, b1, b2, wd, eps,
                                    amsgrad, False) is None
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-22
    assert ((var.double() - want).abs() <= ulp * want.abs() + 1e-6 * lr).all()
    # float32 arithmetic: a few roundings of the terms' magnitudes (then one to the dtype).
    terms = (d[1] * b1).abs() + ((1 - b1) * d[3]).abs()
    assert ((m.double() - m_out).abs() <= 2.0**-22 * terms + ulp * m_out.abs()).all()
    if dtype == torch.float32:
        # f32 grads beside f32 params: bit for bit torch_npu's name.
        assert torch.equal(var, same[0]) and torch.equal(m, same[1]) and torch.equal(v, same[2])
    if amsgrad:
        assert mx.dtype == torch.float32
        assert ((mx.double() - mx_out).abs() <= ulp * mx_out.abs() * 2).all()
    with pytest.raises(ValueError, match="state_step"):
        npu_apply_fused_adamw_v2(var, grad, m, v, None, 0)
    with pytest.raises(TypeError, match="max_exp_avg_sq"):
        npu_apply_fused_adamw_v2(var, grad, m, v, None, 1, amsgrad=True)
    with pytest.raises(TypeError, match="param's dtype"):
        npu_apply_fused_adamw_v2(var, grad, m.float() if dtype != torch.float32 else m.half(), v, None, 1)

