"""Per-family bits of a patched Hugging Face model against the stock one
(docs/huggingface.md, "Bits against the stock model"): 2 layers, vocab 1000,
2 x 64 tokens, bf16 and f32, hidden 256 (64 per head) unless told. Not a
test: a measurement (tests/test_hf_bits.py checks what the docs claim from it).

    python adapters/torch/hf_bits.py                  # add --no-norms to patch all but the norms
    python adapters/torch/hf_bits.py --hidden 512 1024 --seeds 0 1 2 --dtypes bf16 --families llama qwen3
"""
import argparse
import copy

import torch
import transformers as T

import npukern_torch.hf as hf

F = {"llama": (T.LlamaConfig, T.LlamaForCausalLM), "mistral": (T.MistralConfig, T.MistralForCausalLM),
     "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM), "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
     "gemma": (T.GemmaConfig, T.GemmaForCausalLM), "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM),
     "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM)}
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}


def logits_pair(fam, dtype, hidden=256, seed=0, vocab=1000, norms=True, tokens=(2, 64)):
    """(stock logits, patched logits) of a 2-layer `fam` model (head_dim 64,
    norm weights randomized around their init) built with `seed`; `norms`
    False leaves the RMSNorm modules stock. The matmuls stay torch's
    (``linear=False``): the bits measured are the other kernels'; a routed
    matmul has its own summation order (docs/huggingface.md)."""
    C, M = F[fam]
    heads = max(1, hidden // 64)
    cfg = C(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
            max_position_embeddings=tokens[1], attn_implementation="eager")
    torch.manual_seed(seed)
    m = M(cfg)
    with torch.no_grad():
        for _, mod in m.named_modules():
            if type(mod).__name__.endswith("RMSNorm"):
                mod.weight.add_(torch.randn(mod.weight.shape) * 0.3)
    m = m.to(dtype)
    p = copy.deepcopy(m)
    hf.patch(p, rms_norm=norms, linear=False)
    x = torch.randint(0, vocab, tokens, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        return m(x).logits, p(x).logits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[256])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    ap.add_argument("--families", nargs="+", choices=tuple(F), default=list(F))
    ap.add_argument("--no-norms", action="store_true", help="patch all but the norms")
    args = ap.parse_args()
    print("transformers", T.__version__, "torch", torch.__version__, "torch CPU capability",
          torch.backends.cpu.get_cpu_capability())
    for fam in args.families:
        for dt in args.dtypes:
            for hidden in args.hidden:
                for seed in args.seeds:
                    a, b = logits_pair(fam, DTYPES[dt], hidden, seed, args.vocab, not args.no_norms)
                    d = (a != b).sum().item()
                    rel = ((a.double() - b.double()).abs().max() / a.double().abs().max()).item()
                    print(f"{fam:8s} {dt:5s} hidden {hidden:5d} seed {seed}: logits differing {d}/{a.numel()} "
                          f"({d / a.numel():.2e}), max rel {rel:.2e}", flush=True)


if __name__ == "__main__":
    main()
