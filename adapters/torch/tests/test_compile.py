"""torch.library.opcheck on every op (schema, fake implementation, autograd
registration, AOT dispatch with dynamic shapes), and torch.compile with
fullgraph=True of a model built from the modules."""

import pytest
import torch

import npukern_torch

ops = torch.ops.npukern


def _r(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


def samples():
    idx = torch.tensor([[0, 3, 3], [5, 1, 3]])
    grads = [_r(3, 4), _r(5, dtype=torch.bfloat16)]
    return [
        (ops.rms_norm, (_r(4, 3, 8, grad=True), _r(3, 8, grad=True), 1e-6)),
        (ops.rms_norm, (_r(6, 16, dtype=torch.bfloat16, grad=True), _r(16, grad=True), 1e-5)),
        (ops.add_rms_norm, (_r(5, 24, grad=True), _r(5, 24, grad=True), _r(24, grad=True), 1e-6)),
        (ops.rms_norm_backward, (_r(4, 8), _r(4, 8), _r(8), _r(4, 1).abs())),
        (ops.add_rms_norm_backward, (_r(4, 8), _r(4, 8), _r(8), _r(4, 1).abs(), _r(4, 8))),
        (ops.embedding, (_r(6, 5, grad=True), idx, -1, False)),
        (ops.embedding, (_r(6, 5, grad=True), idx, 3, True)),
        (ops.embedding_shard, (_r(3, 5, grad=True), idx, 6, 2, -1, False)),
        (ops.embedding_dense_backward, (_r(2, 3, 7), idx, 6, 3, True)),
        (ops.embedding_dense_backward_shard, (_r(2, 3, 7), idx, 4, 2, -1, False)),
        (ops.grad_stats, (grads,)),
        (ops.clip_grad_norm_, ([g.clone() for g in grads], 0.5, False)),
        # adamw_ without CLIP (its grad_norm output is 0, not NaN: aot_dispatch compares it).
        (ops.adamw_, ([_r(6), _r(5)], [_r(6), _r(5)], [torch.zeros(6), torch.zeros(5)],
                      [torch.zeros(6), torch.zeros(5)], [], [], 1e-3, 0.9, 0.999, 1e-8, 0.01, 1, 0, 0.0, 1.0, 0.0,
                      1.0, [], [], [])),
        (ops.matmul, (_r(5, 7, grad=True), _r(7, 3, grad=True))),
        (ops.matmul, (_r(7, 5, dtype=torch.bfloat16, grad=True), _r(3, 7, dtype=torch.bfloat16, grad=True), True,
                      True)),
        (ops.matmul, (_r(4, 6, dtype=torch.bfloat16), _r(6, 2, dtype=torch.bfloat16), False, False, torch.float32)),
        (ops.matmul_accumulate_, (_r(4, 3), _r(4, 6, dtype=torch.bfloat16), _r(3, 6, dtype=torch.bfloat16), False,
                                  True)),
        (ops.linear, (_r(2, 3, 8, grad=True), _r(5, 8, grad=True), _r(5, grad=True))),
        (ops.linear, (_r(6, 8, dtype=torch.bfloat16, grad=True), _r(5, 8, dtype=torch.bfloat16, grad=True))),
    ]


@pytest.mark.parametrize("i", range(len(samples())))
def test_opcheck(i):
    op, args = samples()[i]
    torch.library.opcheck(op, args)


class TinyLM(torch.nn.Module):
    """Embedding -> (RMSNorm -> MLP, residual) -> AddRMSNorm -> Linear."""

    def __init__(self, vocab=40, hidden=32):
        super().__init__()
        self.emb = npukern_torch.Embedding(vocab, hidden, padding_idx=0)
        self.norm1 = npukern_torch.RMSNorm(hidden)
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden)
        self.norm_f = npukern_torch.AddRMSNorm(hidden, eps=1e-6)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        m = self.down(torch.nn.functional.silu(self.up(self.norm1(h))))
        y, _ = self.norm_f(m, h)
        return self.head(y)


def _step(model, tokens, targets):
    model.zero_grad()
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    eager = TinyLM()
    compiled_model = TinyLM()
    compiled_model.load_state_dict(eager.state_dict())
    compiled = torch.compile(compiled_model, fullgraph=True)
    tokens = torch.randint(0, 40, (4, 12))
    targets = torch.randint(0, 40, (4, 12))
    for _ in range(2):  # the second call reuses the compiled graph
        loss_e, grads_e = _step(eager, tokens, targets)
        loss_c, grads_c = _step(compiled, tokens, targets)
        # Inductor may fuse the surrounding torch ops (Linear, SiLU, loss)
        # differently; the npukern ops run the same kernels.
        assert torch.allclose(loss_c, loss_e, rtol=1e-6, atol=0)
        for a, b in zip(grads_c, grads_e):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    explain = torch._dynamo.explain(TinyLM())(tokens)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
