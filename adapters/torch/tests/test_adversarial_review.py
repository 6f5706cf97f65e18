"""The adversarial review's single-process defects (issue 23), each a test
that failed before its fix. The distributed ones (4, 6) are in
test_parallel.py, defect 1 in test_clip.py."""

import pytest
import torch

import npukern_torch
from conftest import rand

ops = torch.ops.npukern


def _second_derivative(embedding, weight, indices, probe):
    """d/d(probe) of sum(dL/dW ** 2) where L = sum(embedding(indices, W) * probe)."""
    y = embedding(indices, weight)
    (gw,) = torch.autograd.grad((y * probe).sum(), weight, create_graph=True)
    (gp,) = torch.autograd.grad(gw.square().sum(), probe)
    return gp


@pytest.mark.parametrize("padding_idx,scale", [(None, False), (2, False), (None, True)])
def test_embedding_double_backward_matches_torch(padding_idx, scale, gen):
    """Defect 2: create_graph through the embedding gave second derivatives of 0."""
    weight = rand((6, 4), torch.float32, -1, 1, gen=gen).requires_grad_()
    indices = torch.tensor([[1, 2, 1], [5, 2, 0]])
    probe = rand((2, 3, 4), torch.float32, -1, 1, gen=gen).requires_grad_()

    def ours(i, w):
        return npukern_torch.embedding(i, w, padding_idx=padding_idx, scale_grad_by_freq=scale)

    def theirs(i, w):
        # The definition as a float64 composite whose gradient is
        # sum(grad_i / count(id_i)) over the non-padding positions of each id
        # (torch's own double backward ignores scale_grad_by_freq).
        rows = w[i]
        _, inverse, counts = torch.unique(i.reshape(-1), return_inverse=True, return_counts=True)
        s = (1.0 / counts[inverse]).reshape(*i.shape, 1).to(w.dtype) if scale else 1.0
        live = rows * s + rows.detach() * (1 - s)
        return torch.where((i != (-1 if padding_idx is None else padding_idx)).unsqueeze(-1), live, rows.detach())

    got = _second_derivative(ours, weight, indices, probe)
    want = _second_derivative(theirs, weight.double(), indices, probe.double())
    assert got.abs().sum() > 0
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "add_rms_norm"])
def test_norm_double_backward_matches_float64_composite(dtype, fused, gen):
    """Defect 2: create_graph through rms_norm failed with "appears to not have
    been used in the graph"; now the backward runs a differentiable composite.
    Bar: float32 arithmetic throughout (2e-4 of the largest entry), bfloat16
    inputs rounded once on the way in and out (3e-2)."""
    x = rand((3, 16), dtype, -2, 2, gen=gen)
    res = rand((3, 16), dtype, -2, 2, gen=gen)
    gamma = rand((16,), dtype, 0.5, 1.5, gen=gen)

    def hvp(xx, rr, gg, norm):
        y = norm(xx, rr, gg)
        (dx, dg) = torch.autograd.grad(y.square().sum(), (xx, gg), create_graph=True)
        return torch.autograd.grad(dx.sin().sum() + dg.square().sum(), (xx, gg))

    def ours(xx, rr, gg):
        return npukern_torch.add_rms_norm(xx, rr, gg)[0] if fused else npukern_torch.rms_norm(xx, gg)[0]

    def composite(xx, rr, gg):
        s = xx + rr if fused else xx
        return s * torch.rsqrt(s.square().mean(-1, keepdim=True) + 1e-6) * gg

    got = hvp(x.clone().requires_grad_(), res, gamma.clone().requires_grad_(), ours)
    want = hvp(x.double().requires_grad_(), res.double(), gamma.double().requires_grad_(), composite)
    bar = 2e-4 if dtype == torch.float32 else 3e-2
    for g, w in zip(got, want):
        assert (g.double() - w).abs().max() <= bar * w.abs().max(), (g, w)


def test_norm_backward_ops_refuse_to_be_differentiated():
    """Defect 2's other half: the raw backward ops say they have no derivative."""
    dy = torch.ones(2, 4, requires_grad=True)
    dx, _ = ops.rms_norm_backward(dy, torch.ones(2, 4), torch.ones(4), torch.ones(2, 1))
    with pytest.raises(RuntimeError, match="npukern::rms_norm_backward has no derivative"):
        dx.sum().backward()


@pytest.mark.parametrize("shape", [(), (1,) * 8, (2, 1, 3, 1, 1, 1, 1, 2, 1)], ids=["rank0", "rank8", "rank9"])
def test_embedding_any_index_rank_forward_and_backward(shape, gen):
    """Defect 3: indices of rank 0 or 8 passed the forward and crashed the backward."""
    weight = rand((7, 5), torch.float32, -1, 1, gen=gen)
    indices = torch.randint(0, 7, shape, generator=gen)
    w1, w2 = weight.clone().requires_grad_(), weight.clone().requires_grad_()
    y = npukern_torch.embedding(indices, w1)
    y1 = torch.nn.functional.embedding(indices, w2)
    assert y.shape == y1.shape and torch.equal(y, y1)
    up = rand(tuple(y.shape), torch.float32, -1, 1, gen=gen)
    (y * up).sum().backward()
    (y1 * up).sum().backward()
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=1e-6)


def test_list_ops_take_an_empty_list():
    """Defect 5: the raw list ops raised the dispatcher's "no tensor arguments"."""
    stats = ops.grad_stats([])
    assert stats.dtype == torch.float64 and stats[:3].tolist() == [0.0, 0.0, 0.0]
    assert ops.clip_grad_norm_([], 1.0).item() == 0.0


@pytest.mark.parametrize(
    "x_shape,r_shape,r_dtype",
    [((3, 16), (16,), torch.float32), ((16,), (3, 16), torch.float32), ((3, 16), (3, 16), torch.bfloat16),
     ((3, 16), (3, 16), torch.float64)],
    ids=["broadcast residual", "broadcast x", "residual bf16", "residual f64"],
)
def test_add_rms_norm_module_broadcasts_and_promotes(x_shape, r_shape, r_dtype, gen):
    """Defect 7: one behaviour -- torch's broadcasting and type promotion of
    x + residual -- whichever path runs."""
    m = npukern_torch.AddRMSNorm(16)
    x = rand(x_shape, torch.float32, -2, 2, gen=gen)
    r = rand(r_shape, torch.float32, -2, 2, gen=gen).to(r_dtype)
    y, s = m(x, r)
    want_s = x + r
    assert s.dtype == want_s.dtype and s.shape == want_s.shape and torch.equal(s, want_s)
    torch.testing.assert_close(y, torch.nn.RMSNorm(16, eps=m.eps).to(s.dtype)(want_s), rtol=2e-6, atol=2e-6)


def test_float16_norm_beyond_65504_agrees_with_its_coefficient(gen):
    """Defect 8: float16 gradients whose exact norm exceeds 65504 returned inf
    but were scaled by a finite coefficient. Now: the exact norm in float32,
    and the gradients scaled by min(1, max_norm / (norm + 1e-6)) of it."""
    p = torch.nn.Parameter(torch.zeros(64, dtype=torch.float16))
    p.grad = torch.full((64,), 30000.0, dtype=torch.float16)
    total = npukern_torch.clip_grad_norm_([p], 1.0)
    assert total.dtype == torch.float32 and total.item() == pytest.approx(240000.0, rel=1e-7)
    coef = 1.0 / (total.item() + 1e-6)
    want = (torch.full((64,), 30000.0, dtype=torch.float64) * coef).to(torch.float16)
    assert torch.equal(p.grad, want)


def test_float32_norm_beyond_float32_range_zeroes_like_torch():
    """Defect 8's corner in float32: a norm past 3.4e38 is returned as inf,
    and the gradients get that norm's coefficient, 0 (as torch does)."""
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3e38)
    total = npukern_torch.clip_grad_norm_([p], 1.0)
    assert total.dtype == torch.float32 and torch.isinf(total)
    assert torch.equal(p.grad, torch.zeros(4))


@pytest.mark.parametrize("padding_idx", [-5, -2, 10, 100])
def test_raw_embedding_op_validates_padding_idx(padding_idx):
    """Defect 9: the raw op accepted padding_idx -5 and 100 silently."""
    with pytest.raises(ValueError, match="Padding_idx must be within num_embeddings"):
        ops.embedding(torch.ones(10, 3), torch.tensor([1, 2]), padding_idx)
    with pytest.raises(ValueError, match="Padding_idx must be within num_embeddings"):
        ops.embedding_shard(torch.ones(5, 3), torch.tensor([1, 2]), 10, 0, padding_idx)
    ops.embedding(torch.ones(10, 3), torch.tensor([1, 2]), 9)  # the last row is a valid padding id
