"""hf.patch swaps an MLP's forward only where that forward is
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: transformers has MLPs with
the same parts whose forward does more (Seed-OSS's dropout, Falcon-H1's
multipliers, Gemma-3n's sparsity, DeepSeek-V4's clamps, GLM-4V's projection
first). Before, any module with the parts was swapped and silently computed
another function (a Seed-OSS MLP in training mode lost its dropout)."""

import copy
import functools
import warnings

import pytest
import torch
import transformers as T

from npukern_torch import hf


class _Parts(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.gate_proj = torch.nn.Linear(8, 16, bias=False)
        self.up_proj = torch.nn.Linear(8, 16, bias=False)
        self.down_proj = torch.nn.Linear(16, 8, bias=False)
        self.act_fn = torch.nn.SiLU()
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


# The gated MLP, written as transformers' families write it.
class OneLocal(_Parts):
    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class Direct(_Parts):
    def forward(self, hidden_state):
        """A docstring is not a statement of the forward."""
        return self.down_proj(self.act_fn(self.gate_proj(hidden_state)) * self.up_proj(hidden_state))


class ActLocal(_Parts):  # RecurrentGemma's
    def forward(self, hidden_states):
        gate = self.act_fn(self.gate_proj(hidden_states))
        return self.down_proj(gate * self.up_proj(hidden_states))


class UpFirst(_Parts):
    def forward(self, x):
        return self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))


SAME = [OneLocal, Direct, ActLocal, UpFirst]


# Same parts, another function.
class Dropout(_Parts):  # Seed-OSS's
    def forward(self, x):
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        down_proj = torch.nn.functional.dropout(down_proj, p=0.5, training=self.training)
        return down_proj


class Scaled(_Parts):  # Falcon-H1's
    def forward(self, x):
        y = self.up_proj(x) * self.act_fn(self.gate_proj(x) * 0.5)
        return self.down_proj(y)


class Clamped(_Parts):  # DeepSeek-V4's
    def forward(self, x):
        gate = self.gate_proj(x).clamp(max=0.5)
        return self.down_proj(self.act_fn(gate) * self.up_proj(x))


class GlobalScale(_Parts):  # Inkling's
    def forward(self, hidden_states):
        hidden_states = self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))
        return hidden_states * 2.0


class Twice(_Parts):
    def forward(self, x):
        g = self.act_fn(self.gate_proj(x))
        return self.down_proj(g * self.up_proj(x)) + g.sum()


class Unused(_Parts):
    def forward(self, x):
        spare = self.up_proj(x)  # noqa: F841
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ReassignsInput(_Parts):
    def forward(self, x):
        x = x * 2
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Keyword(_Parts):
    def forward(self, x, scale=1.0):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * scale


def _decorated(f):
    @functools.wraps(f)
    def wrapper(self, x):
        return f(self, x) * 3.0
    return wrapper


class Decorated(_Parts):
    @_decorated
    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


OTHER = [Dropout, Scaled, Clamped, GlobalScale, Twice, Unused, ReassignsInput, Keyword, Decorated]


def _twins(cls):
    stock = cls()
    patched = copy.deepcopy(stock)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = hf.patch(patched)
    return stock, patched, counts, [str(w.message) for w in caught]


@pytest.mark.parametrize("cls", SAME, ids=lambda c: c.__name__)
def test_the_gated_mlp_is_swapped_in_each_way_it_is_written(cls):
    stock, patched, counts, warned = _twins(cls)
    assert counts["mlp"] == 1 and not warned
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    stock, patched = stock.bfloat16(), patched.bfloat16()
    assert torch.equal(stock(x), patched(x))  # the swap keeps the stock bits


@pytest.mark.parametrize("cls", OTHER, ids=lambda c: c.__name__)
def test_an_mlp_that_computes_more_is_left_alone_and_named(cls):
    stock, patched, counts, warned = _twins(cls)
    assert counts["mlp"] == 0
    assert "forward" not in vars(patched)
    assert any("MLP classes alone" in w and cls.__qualname__ in w for w in warned), warned
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(7)
    want = stock(x)
    torch.manual_seed(7)
    assert torch.equal(patched(x), want)


def test_mlp_false_warns_of_no_mlp():
    patched = Dropout()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf.patch(patched, mlp=False)
    assert not [w for w in caught if "MLP classes" in str(w.message)]


@pytest.mark.skipif(not hasattr(T, "SeedOssForCausalLM"), reason="this transformers has no Seed-OSS")
def test_seed_oss_keeps_its_residual_dropout_in_training():
    cfg = T.SeedOssConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=64, attention_dropout=0.0, residual_dropout=0.1)
    torch.manual_seed(0)
    stock = T.SeedOssForCausalLM(cfg).train()
    patched = copy.deepcopy(stock)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        counts = hf.patch(patched)
    assert counts["mlp"] == 0
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(11)
    want = stock(ids, labels=ids).loss
    torch.manual_seed(11)
    got = patched(ids, labels=ids).loss
    # The same dropout masks: the loss as stock's (the embedding's swap
    # keeps its bits).
    assert torch.equal(got, want)
