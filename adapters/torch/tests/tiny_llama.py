"""A tiny LLaMA-like language model and a fixed synthetic task, built either
from torch's modules or from npukern_torch's (the loss-curve test and the
distributed tests train it).

Model: Embedding -> RMSNorm -> 2 x (MLP, residual add + RMSNorm) -> Linear.
Task: next-token prediction on sequences of a fixed recurrence
t[i+1] = (7 t[i] + 3) mod V from random starts, with a padding
token 0 in front of every sequence (padding_idx=0)."""

import torch

VOCAB, HIDDEN, SEQ, BATCH, LAYERS = 50, 32, 16, 8, 2


class TorchAddNorm(torch.nn.RMSNorm):
    """The unfused reference of npukern_torch.AddRMSNorm: (norm(x + r), x + r)."""

    def forward(self, x, residual):
        s = x + residual
        return super().forward(s), s


class TinyLlama(torch.nn.Module):
    def __init__(self, embedding, norm_cls, add_norm_cls, dtype=torch.float32):
        super().__init__()
        self.emb = embedding
        self.norm0 = norm_cls(HIDDEN, eps=1e-6, dtype=dtype)
        self.up = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, 2 * HIDDEN, dtype=dtype) for _ in range(LAYERS))
        self.down = torch.nn.ModuleList(torch.nn.Linear(2 * HIDDEN, HIDDEN, dtype=dtype) for _ in range(LAYERS))
        self.norms = torch.nn.ModuleList(add_norm_cls(HIDDEN, eps=1e-6, dtype=dtype) for _ in range(LAYERS))
        self.head = torch.nn.Linear(HIDDEN, VOCAB, dtype=dtype)

    def forward(self, tokens):
        h = self.emb(tokens)
        x = self.norm0(h)
        for up, down, norm in zip(self.up, self.down, self.norms):
            m = down(torch.nn.functional.silu(up(x)))
            x, h = norm(m, h)
        return self.head(x)


def torch_model(dtype=torch.float32):
    emb = torch.nn.Embedding(VOCAB, HIDDEN, padding_idx=0, dtype=dtype)
    return TinyLlama(emb, torch.nn.RMSNorm, TorchAddNorm, dtype)


def npukern_model(embedding=None):
    import npukern_torch

    emb = embedding if embedding is not None else npukern_torch.Embedding(VOCAB, HIDDEN, padding_idx=0)
    return TinyLlama(emb, npukern_torch.RMSNorm, npukern_torch.AddRMSNorm)


def initial_state(seed=1234):
    """One fixed float32 initialization, loaded into every variant."""
    torch.manual_seed(seed)
    return torch_model().state_dict()


def batches(steps, seed=99):
    """`steps` fixed (tokens, targets) batches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        seq = torch.zeros(BATCH, SEQ + 1, dtype=torch.int64)
        seq[:, 1] = torch.randint(1, VOCAB, (BATCH,), generator=g)
        for i in range(2, SEQ + 1):
            seq[:, i] = (7 * seq[:, i - 1] + 3) % VOCAB
        out.append((seq[:, :-1].clone(), seq[:, 1:].clone()))
    return out


def loss_fn(model, tokens, targets):
    logits = model(tokens)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
