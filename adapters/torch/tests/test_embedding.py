"""embedding_dense_backward against PyTorch's own
(torch.ops.aten.embedding_dense_backward) in float64, and the Embedding
module against torch.nn.Embedding.

Bar: each output element is one f32 sum of its row's k gradient terms in
ascending position order, rounded once to the output dtype, so
|got - ref| <= 1 ulp(ref) of the output dtype + k * 2^-24 * (the float64 sum of
|terms|) (the bound of k f32 additions), where ref is aten's result on the
float64 gradient."""

import pytest
import torch

import npukern_torch
from conftest import DTYPES, rand, record, ulp

ops = torch.ops.npukern


def aten64(grad, indices, num_weights, padding_idx, scale):
    return torch.ops.aten.embedding_dense_backward(grad.double(), indices, num_weights, padding_idx, scale)


def check_against_aten(grad, indices, num_weights, padding_idx, scale, label):
    got = ops.embedding_dense_backward(grad, indices, num_weights, padding_idx, scale)
    ref = aten64(grad, indices, num_weights, padding_idx, scale)
    abs_sum = aten64(grad.abs(), indices, num_weights, padding_idx, scale)
    assert got.dtype == grad.dtype and got.shape == ref.shape
    count = torch.bincount(indices.reshape(-1).long(), minlength=num_weights)[:num_weights]
    bar = ulp(ref, grad.dtype) + count.double().unsqueeze(1) * 2.0**-24 * abs_sum
    score = ((got.double() - ref).abs() / bar).max().item() if got.numel() else 0.0
    record(f"embedding grad score ({grad.dtype}) {label}", score)
    assert score <= 1.0, f"score {score}"
    return got, ref


def _case(gen, n, h, v, dtype, idx_dtype=torch.int64, shape=None):
    indices = torch.randint(0, v, (n,) if shape is None else shape, generator=gen, dtype=idx_dtype)
    grad = rand((*indices.shape, h), dtype, gen=gen)
    return grad, indices


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("padding_idx", [-1, -3, 0, 5], ids=lambda p: f"pad{p}")
@pytest.mark.parametrize("scale", [False, True], ids=["sum", "freq"])
def test_against_aten(dtype, padding_idx, scale, gen):
    # Duplicates (300 positions into 12 rows), H not a multiple of 16, 2-D indices.
    grad, indices = _case(gen, None, 37, 12, dtype, shape=(20, 15))
    got, _ = check_against_aten(grad, indices, 12, padding_idx, scale, "aten cases")
    if padding_idx >= 0:
        assert (got[padding_idx] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("scale", [False, True], ids=["sum", "freq"])
def test_few_indices_into_a_large_table(dtype, scale, gen):
    # A table of 8 MiB or more that the indices hit sparsely: the op takes
    # zeros from the OS and adds into the rows hit (accumulate); the same
    # values, untouched rows zero, a tensor like any other afterwards.
    v, h = 40000, 136
    grad, indices = _case(gen, None, h, v, dtype, shape=(4, 60))
    indices[0, :5] = 7  # duplicates
    indices[1, 0] = v - 1  # the last row (the mapping's last page)
    got, ref = check_against_aten(grad, indices, v, 3, scale, "large sparse table")
    untouched = torch.ones(v, dtype=torch.bool)
    untouched[indices.long().reshape(-1)] = False
    assert (got[untouched] == 0).all() and (got[3] == 0).all()
    assert torch.equal(got, ops.embedding_dense_backward(grad, indices, v, 3, scale))
    got.add_(1)  # writable, every page
    assert (got[untouched] == 1).all()
    del got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shapes_and_index_dtypes(dtype, gen):
    for n, h, v in [(1, 1, 1), (5, 16, 3), (64, 1, 1000), (1000, 33, 7), (300, 300, 50)]:
        for idx_dtype in (torch.int64, torch.int32):
            grad, indices = _case(gen, n, h, v, dtype, idx_dtype)
            got, _ = check_against_aten(grad, indices, v, -1, False, "shapes")
            untouched = torch.ones(v, dtype=torch.bool)
            untouched[indices.long()] = False
            assert (got[untouched] == 0).all()


def test_many_duplicates_bf16(gen):
    """20000 copies of one row in bfloat16: one rounding of an f32 sum."""
    n, h = 20000, 16
    grad = rand((n, h), torch.bfloat16, 0.0, 1.0, gen=gen)
    indices = torch.zeros(n, dtype=torch.int64)
    got, ref = check_against_aten(grad, indices, 2, -1, False, "20000 duplicates")
    # PyTorch's CPU kernel, accumulating in bfloat16, for comparison.
    torch_bf16 = torch.ops.aten.embedding_dense_backward(grad, indices, 2, -1, False)
    record("torch's own bf16 embedding backward rel err, 20000 duplicates",
           ((torch_bf16[0].double() - ref[0]).abs() / ref[0]).max())
    record("npukern bf16 embedding backward rel err, 20000 duplicates",
           ((got[0].double() - ref[0]).abs() / ref[0]).max())


def test_empty_and_degenerate(gen):
    grad = torch.zeros((0, 8))
    got = ops.embedding_dense_backward(grad, torch.zeros(0, dtype=torch.int64), 5, -1, False)
    assert got.shape == (5, 8) and (got == 0).all()
    got = ops.embedding_dense_backward(torch.zeros((3, 0)), torch.tensor([0, 1, 2]), 4, -1, False)
    assert got.shape == (4, 0)
    got = ops.embedding_dense_backward(torch.zeros((0, 3)), torch.zeros(0, dtype=torch.int64), 0, -1, False)
    assert got.shape == (0, 3)


@pytest.mark.parametrize("padding_idx", [None, 0, 3, -1, -10], ids=str)
@pytest.mark.parametrize("scale", [False, True], ids=["sum", "freq"])
def test_module_matches_torch_embedding(padding_idx, scale, gen):
    torch.manual_seed(7)
    ref = torch.nn.Embedding(10, 24, padding_idx=padding_idx, scale_grad_by_freq=scale)
    mod = npukern_torch.Embedding(10, 24, padding_idx=padding_idx, scale_grad_by_freq=scale)
    assert isinstance(mod, torch.nn.Embedding) and mod.padding_idx == ref.padding_idx
    mod.load_state_dict(ref.state_dict())
    indices = torch.randint(0, 10, (6, 9), generator=gen)
    indices[0, :4] = 9 if padding_idx is None else ref.padding_idx  # duplicates of the padding row
    up = rand((6, 9, 24), torch.float32, gen=gen)
    out, out_ref = mod(indices), ref(indices)
    assert torch.equal(out, out_ref)
    (out * up).sum().backward()
    (out_ref * up).sum().backward()
    # Same float32 terms, summed in a possibly different order.
    ref64 = aten64(up, indices, 10, -1 if ref.padding_idx is None else ref.padding_idx, scale)
    err = (mod.weight.grad.double() - ref64).abs().max().item()
    err_torch = (ref.weight.grad.double() - ref64).abs().max().item()
    record("Embedding module f32 grad abs err vs float64", err)
    assert err <= max(2 * err_torch, 1e-6)
    if ref.padding_idx is not None:
        assert (mod.weight.grad[ref.padding_idx] == 0).all()


def test_module_bf16_and_from_pretrained(gen):
    w = rand((50, 20), torch.bfloat16, gen=gen)
    mod = npukern_torch.Embedding.from_pretrained(w, freeze=False, padding_idx=-2)
    assert type(mod) is npukern_torch.Embedding and mod.padding_idx == 48
    indices = torch.randint(0, 50, (200,), generator=gen)
    up = rand((200, 20), torch.bfloat16, gen=gen)
    (mod(indices) * up).sum().backward()
    check_against_aten(up, indices, 50, 48, False, "module bf16")
    expect = ops.embedding_dense_backward(up, indices, 50, 48, False)
    assert torch.equal(mod.weight.grad, expect)


def test_module_refuses_sparse_and_max_norm():
    with pytest.raises(ValueError, match="sparse"):
        npukern_torch.Embedding(4, 4, sparse=True)
    with pytest.raises(ValueError, match="max_norm"):
        npukern_torch.Embedding(4, 4, max_norm=1.0)
    with pytest.raises(ValueError, match="max_norm"):
        npukern_torch.Embedding.from_pretrained(torch.ones(4, 4), max_norm=1.0)


def test_functional_embedding_padding(gen):
    w = rand((8, 4), torch.float32, gen=gen).requires_grad_()
    idx = torch.tensor([7, 7, 1])
    npukern_torch.embedding(idx, w, padding_idx=-1).sum().backward()
    assert (w.grad[7] == 0).all() and (w.grad[1] == 1).all()
    with pytest.raises(ValueError):
        npukern_torch.embedding(idx, w, padding_idx=8)
