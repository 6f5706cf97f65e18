"""linear_cross_entropy's 16-bit weight gradient against float64, as close
as stock's (logits in the weight's dtype, F.cross_entropy of their float32
copy, backward) whatever the number of chunks. Each chunk's part of the
gradient used to be a matmul rounded to the weight's dtype before the
float32 sum, one extra rounding per chunk: 1.3-1.7x stock's error (max
|diff| over max |entry|) at 2-32 chunks; now the parts are float32 and the
error is stock's."""

import pytest
import torch

import npukern_torch

N, H, V = 512, 64, 4096


def max_rel(got, ref):
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("chunks", (1, 2, 4, 16))
@pytest.mark.parametrize("reduction", ("mean", "sum"))
def test_weight_grad_as_close_to_float64_as_stock(dtype, chunks, reduction):
    g = torch.Generator().manual_seed(chunks)
    x = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.05).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    w64 = w.double().requires_grad_()
    torch.nn.functional.cross_entropy(x.double() @ w64.t(), t, reduction=reduction).backward()
    ws = w.clone().requires_grad_()
    torch.nn.functional.cross_entropy((x @ ws.t()).float(), t, reduction=reduction).backward()
    wn = w.clone().requires_grad_()
    chunk_bytes = N // chunks * V * x.element_size()
    npukern_torch.linear_cross_entropy(x, wn, t, reduction=reduction, chunk_bytes=chunk_bytes).backward()
    stock, ours = max_rel(ws.grad, w64.grad), max_rel(wn.grad, w64.grad)
    # Stock's own error is one rounding of the result (2^-9 of an entry
    # near the largest, plus the 16-bit dlogits); allow 10% for the order.
    assert ours <= 1.1 * stock, f"{chunks} chunks: {ours:.2e} against float64, stock {stock:.2e}"


def test_chunk_rows_rule():
    """The default budget takes one chunk where its logits cost no more
    than chunking plus the weight gradient's float32 sums; an explicit
    budget is a bound; no weight gradient, no sums to weigh."""
    from npukern_torch import loss as L

    v, h = 151936, 1536
    budget_rows = L.CHUNK_BYTES // (v * 2)
    # Qwen2.5-1.5B's head over 512 tokens: 156 MB of logits against the
    # 134 MB budget plus 934 MB of sums.
    assert budget_rows < 512
    assert L._chunk_rows(512, v, h, 2, None, True) == 512
    assert L._chunk_rows(512, v, h, 2, L.CHUNK_BYTES, True) == budget_rows
    assert L._chunk_rows(512, v, h, 2, None, False) == budget_rows
    # The edge: up to h tokens past the budget (16-bit) are one chunk (the
    # logits and the bf16 gradient against a chunk and the float32 sums),
    # one more is not.
    assert L._chunk_rows(budget_rows + h, v, h, 2, None, True) == budget_rows + h
    assert L._chunk_rows(budget_rows + h + 1, v, h, 2, None, True) == budget_rows
    # float32: the sums are the gradient's own size, so never.
    rows32 = L.CHUNK_BYTES // (v * 4)
    assert L._chunk_rows(rows32 + 1, v, h, 4, None, True) == rows32
    # Fewer tokens than the budget: all of them, as before.
    assert L._chunk_rows(100, v, h, 2, None, True) == 100


class _Counting:
    """torch.ops.npukern with its cross_entropy_fused_ calls (one a chunk)
    counted."""

    def __init__(self, ops):
        self.ops, self.calls = ops, 0

    def __getattr__(self, name):
        if name == "cross_entropy_fused_":
            self.calls += 1
        return getattr(self.ops, name)


@pytest.mark.parametrize("matmul", ("torch", "npukern"))
def test_default_budget_takes_one_chunk_where_it_holds_less(monkeypatch, matmul):
    """Under a default budget of 8 rows (even: the pair dot's chunks), 40
    tokens of a 64-wide head are one chunk (32 rows more than the budget <=
    64), bitwise what an explicit one-chunk budget gives; 200 tokens
    are 25 chunks, as the explicit 8-row budget cuts them; a frozen weight
    (no float32 sums) keeps the budget's chunks."""
    from npukern_torch import loss as L

    dtype, h, v = torch.bfloat16, 64, 1000
    monkeypatch.setattr(L, "CHUNK_BYTES", 8 * v * 2)
    count = _Counting(L.ops)
    monkeypatch.setattr(L, "ops", count)
    g = torch.Generator().manual_seed(5)
    for n, explicit, chunks, weight_grad in ((40, 40 * v * 2, 1, True), (200, 8 * v * 2, 25, True),
                                             (40, 8 * v * 2, 5, False)):
        x = torch.randn(n, h, generator=g).to(dtype)
        w = (torch.randn(v, h, generator=g) * 0.05).to(dtype)
        t = torch.randint(0, v, (n,), generator=g)
        results = []
        for cb in (None, explicit):
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_(weight_grad)
            count.calls = 0
            loss = npukern_torch.linear_cross_entropy(xi, wi, t, chunk_bytes=cb, matmul=matmul)
            assert count.calls == chunks, f"{n} tokens, chunk_bytes {cb}: {count.calls} chunks, not {chunks}"
            loss.backward()
            results.append((loss.detach(), xi.grad, wi.grad if weight_grad else xi.grad))
        for a, b in zip(*results):
            assert torch.equal(a, b), f"{n} tokens: the default budget's result differs"
