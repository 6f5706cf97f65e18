"""Tiny Hugging Face models of every family npukern_torch.hf supports, built
from configs in the test (no download), with non-trivial norm weights."""

import copy

import torch
import transformers as T

VOCAB = 96

FAMILIES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM),
    "mistral": (T.MistralConfig, T.MistralForCausalLM),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM),
}
# RMSNorm modules per model: 2 per layer + the final one; Qwen3 adds q/k
# norms (2 per layer); Gemma2 has 4 per layer, Gemma3 4 + q/k.
NORMS = {"llama": 5, "mistral": 5, "qwen2": 5, "qwen3": 9, "gemma": 5, "gemma2": 9, "gemma3": 13}


def build(family, dtype=torch.float32, seed=0):
    """A 2-layer model (hidden 64, vocab 96, eager attention) whose RMSNorm
    weights are randomized around the family's init (ones for Llama's,
    zeros for Gemma's zero-centred weights), in `dtype`."""
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                        attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.add_(torch.randn(module.weight.shape, generator=g) * 0.3)
    return model.to(dtype)


def twin(model):
    """An independent copy (its own Parameters) to patch."""
    return copy.deepcopy(model)


def tokens(batch=2, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)
