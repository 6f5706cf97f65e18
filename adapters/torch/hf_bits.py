"""Per-family bits of a patched Hugging Face model against the stock one
(docs/huggingface.md, "Bits against the stock model"): 2 layers, hidden
256, vocab 1000, 2 x 64 tokens, bf16 and f32. Not a test: a measurement.

    python adapters/torch/hf_bits.py            # add --no-norms to patch all but the norms
"""
import sys

import copy, torch, transformers as T, npukern_torch.hf as hf
F = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "mistral": (T.MistralConfig, T.MistralForCausalLM),
     "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM), "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
     "gemma": (T.GemmaConfig, T.GemmaForCausalLM), "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM),
     "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM)}
print("transformers", T.__version__, "torch", torch.__version__)
for fam, (C, M) in F.items():
    for dt in (torch.bfloat16, torch.float32):
        cfg = C(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=128, attn_implementation="eager")
        torch.manual_seed(0); m = M(cfg)
        with torch.no_grad():
            for n, mod in m.named_modules():
                if type(mod).__name__.endswith("RMSNorm"): mod.weight.add_(torch.randn(mod.weight.shape) * 0.3)
        m = m.to(dt); p = copy.deepcopy(m); hf.patch(p, rms_norm="--no-norms" not in sys.argv)
        x = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1))
        with torch.no_grad(): a, b = m(x).logits, p(x).logits
        d = (a != b).sum().item()
        rel = ((a.double() - b.double()).abs().max() / a.double().abs().max()).item()
        print(f"{fam:8s} {str(dt)[6:]:9s} logits differing {d}/{a.numel()} ({d/a.numel():.2e}), max rel {rel:.2e}")
