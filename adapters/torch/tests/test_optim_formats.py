"""npukern_torch.optim's compact state (issue 56): split masters, bf16
moments and bf16 params rounded stochastically. Split masters are the
float32 masters bit for bit; every mode counts the bytes it promises, keeps
its bits across thread counts, and crosses state_dict, deepcopy and torch's
AdamW both ways."""

import copy
import io

import pytest
import torch

from conftest import bytes_per_param
from npukern_torch.optim import AdamW, join_master, split_master

BF16 = torch.bfloat16


def _run(steps=60, shape=(300, 37), threads=None, **kw):
    g = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(*shape, generator=g).to(BF16))
    b = torch.nn.Parameter(torch.randn(shape[1], generator=g).to(BF16))
    opt = AdamW([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=1e-3, max_grad_norm=1.0, **kw)
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        for _ in range(steps):
            w.grad = (torch.randn(shape, generator=g) * 1e-2).to(BF16)
            b.grad = (torch.randn(shape[1], generator=g) * 1e-2).to(BF16)
            opt.step()
    finally:
        torch.set_num_threads(old)
    return (w, b), opt


def test_split_and_join_are_exact_and_round_to_nearest():
    m = torch.randn(200_000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-35, 35, 200_000)
    m[:4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
    hi, lo = split_master(m)
    assert hi.dtype == BF16 and lo.dtype == torch.int16
    assert torch.equal(join_master(hi, lo).view(torch.int32), m.view(torch.int32))
    ties = (m.view(torch.int32) & 0xFFFF) == 0x8000
    assert torch.equal(hi[~ties].view(torch.int16), m.to(BF16)[~ties].view(torch.int16))
    assert join_master(*split_master(torch.tensor([float("nan")])))[0].isnan()


def test_split_masters_are_float32_masters_bit_for_bit():
    (wa, ba), a = _run(master_weights=True)
    (wb, bb), b = _run(master_weights="split")
    for pa, pb in ((wa, wb), (ba, bb)):
        master = join_master(pb, b.state[pb]["master_low"])
        assert torch.equal(master.view(torch.int32), a.state[pa]["master"].view(torch.int32))
        assert torch.equal(a.state[pa]["exp_avg"], b.state[pb]["exp_avg"])
        assert torch.equal(a.state[pa]["exp_avg_sq"], b.state[pb]["exp_avg_sq"])
        differ = pa.view(torch.int16) != pb.view(torch.int16)
        # Only where the master is exactly halfway between two bf16 values.
        assert bool(((master.view(torch.int32)[differ] & 0xFFFF) == 0x8000).all())


@pytest.mark.parametrize("kw, want", [
    (dict(master_weights=True), 16),
    (dict(master_weights="split"), 14),
    (dict(master_weights="split", state_dtype=BF16), 10),
    (dict(stochastic_rounding=True, state_dtype=BF16), 8),
])
def test_bytes_per_param_counted_from_the_tensors(kw, want):
    params, opt = _run(steps=1, **kw)
    assert bytes_per_param(params, opt) == want


@pytest.mark.parametrize("kw", [
    dict(master_weights="split", state_dtype=BF16),
    dict(stochastic_rounding=True, state_dtype=BF16, amsgrad=True),
])
def test_stochastic_rounding_is_the_same_on_one_and_two_threads_and_follows_the_seed(kw):
    (w1, _), o1 = _run(threads=1, **kw)
    (w2, _), o2 = _run(threads=2, **kw)
    assert torch.equal(w1.view(torch.int16), w2.view(torch.int16))
    assert torch.equal(o1.state[w1]["exp_avg_sq"].view(torch.int16), o2.state[w2]["exp_avg_sq"].view(torch.int16))
    (w3, _), o3 = _run(seed=7, **kw)
    assert not torch.equal(o1.state[w1]["exp_avg"].view(torch.int16), o3.state[w3]["exp_avg"].view(torch.int16))


def test_stochastic_rounding_tracks_float32_masters_closer_than_round_to_nearest():
    (wm, _), _ = _run(steps=200, master_weights=True)
    (ws, _), _ = _run(steps=200, stochastic_rounding=True)
    (wn, _), _ = _run(steps=200)
    off = lambda w: (w.float() - wm.float()).abs().mean().item()  # noqa: E731
    assert off(ws) < off(wn)


def test_state_dict_crosses_torch_and_the_other_master_formats():
    (w, b), opt = _run(master_weights="split", state_dtype=BF16)
    sd = opt.state_dict()
    assert sd["param_groups"][0]["seed"] == 0
    groups = lambda: [{"params": [w]}, {"params": [b]}]  # noqa: E731
    theirs = torch.optim.AdamW(groups())
    theirs.load_state_dict(copy.deepcopy(sd))
    theirs.step()  # torch steps with the bf16 moments it cast
    again = AdamW(groups(), master_weights="split", state_dtype=BF16)
    again.load_state_dict(sd)
    assert again.state[w]["master_low"].dtype == torch.int16
    assert torch.equal(again.state[w]["master_low"], opt.state[w]["master_low"])
    # Through torch's load (it casts the int16 low halves to bf16: gone) the
    # masters start again from the params.
    back = AdamW(groups(), master_weights="split", state_dtype=BF16)
    back.load_state_dict(theirs.state_dict())
    assert not back.state[w]["master_low"].any()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    f32 = AdamW(groups(), master_weights=True)
    f32.load_state_dict(torch.load(buf))
    assert f32.state[w]["exp_avg"].dtype == torch.float32
    assert torch.equal(f32.state[w]["master"], join_master(w, opt.state[w]["master_low"]))
    split = AdamW(groups(), master_weights="split")
    split.load_state_dict(f32.state_dict())
    assert torch.equal(join_master(w, split.state[w]["master_low"]), f32.state[w]["master"])


def test_deepcopy_keeps_the_formats():
    (w, _), opt = _run(steps=2, master_weights="split", state_dtype=BF16, seed=5)
    c = copy.deepcopy(opt)
    assert (c.master_weights, c.state_dtype, c.param_groups[0]["seed"]) == ("split", BF16, 5)
    c.step()


def test_bad_formats_are_refused():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="float16 params need master_weights=True"):
        AdamW([p], master_weights="split")
    q = torch.nn.Parameter(torch.zeros(3, dtype=BF16))
    with pytest.raises(ValueError, match="stochastic_rounding"):
        AdamW([q], master_weights=True, stochastic_rounding=True)
    with pytest.raises(ValueError, match="state_dtype"):
        AdamW([q], state_dtype=torch.float16)
    with pytest.raises(ValueError, match="master_weights must be"):
        AdamW([q], master_weights="int8")
