"""The model that does not fit the usual recipe: a Qwen2.5-1.5B-shaped model
(hidden 1536, 28 layers, 12 heads, 2 KV heads, intermediate 8960, vocab
151 936, tied embeddings; random init, no download), held in bf16,
``hf.patch``-ed, trained a few full steps (forward, backward, clip, step)
with ``npukern_torch.optim.AdamW(master_weights="split",
state_dtype="int8", max_grad_norm=1.0)``. Prints each step's time, the
process's peak RSS, and the bytes per parameter the run holds (params,
grads and every optimizer state tensor, counted from the tensors) beside
what the stock recipe (float32 params, grads and moments under autocast)
and float32 masters (``master_weights=True``) would hold for the same
params (16 bytes each: 24.7 GB here, more than this 24 GB machine's
memory before the first activation).

    python benches/qwen_1p5b.py [--steps 3] [--seq 512] [--threads 2]
        [--master split|true|false] [--state int8|bfloat16|float32]

Not a test: a measurement (minutes per run; ~14 GB of memory).
"""

import argparse
import resource
import time


def tensor_bytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--master", choices=("split", "true", "false"), default="split")
    ap.add_argument("--state", choices=("int8", "bfloat16", "float32"), default="int8")
    a = ap.parse_args()

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import npukern_torch
    from npukern_torch import hf
    from npukern_torch.optim import AdamW

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=a.layers,
                      num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                      max_position_embeddings=max(a.seq, 32768), tie_word_embeddings=True,
                      rope_theta=1e6, rms_norm_eps=1e-6, attn_implementation="sdpa")
    # Built directly in bf16: a float32 build would peak at twice the params.
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen2ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.train()
    hf.patch(model)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    master = {"split": "split", "true": True, "false": False}[a.master]
    state = {"int8": "int8", "bfloat16": torch.bfloat16, "float32": torch.float32}[a.state]
    opt = AdamW(params, lr=1e-4, weight_decay=0.01, max_grad_norm=1.0, master_weights=master,
                stochastic_rounding=master is False, state_dtype=state)
    g = torch.Generator().manual_seed(1)
    print(f"Qwen2.5-1.5B-shaped: {n / 1e9:.3f} B params ({a.layers} layers), bf16, seq {a.seq} x batch {a.batch}, "
          f"{a.threads} threads; torch {torch.__version__}, npukern {npukern_torch.library_version} "
          f"({npukern_torch.detected_isa}); AdamW(master_weights={master!r}, state_dtype={a.state!r})")
    for step in range(a.steps):
        x = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), generator=g)
        t = time.perf_counter()
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # grads kept, as a training loop's second step finds them
        dt = time.perf_counter() - t
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
        print(f"step {step + 1}: {dt:.1f} s, loss {loss.item():.4f}, grad norm {float(opt.grad_norm):.3f}, "
              f"peak RSS so far {rss:.2f} GiB")
    held = tensor_bytes(params) + tensor_bytes(p.grad for p in params if p.grad is not None)
    held += sum(tensor_bytes(v for v in st.values() if torch.is_tensor(v) and v.dim() > 0) for st in opt.state.values())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\n| recipe | bytes / param | params + grads + state |")
    print("|---|---:|---:|")
    print(f"| this run (measured from its tensors) | {held / n:.2f} | {held / 1e9:.2f} GB |")
    print(f"| float32 masters (2 + 2 + 4 + 8, computed) | 16 | {16 * n / 1e9:.2f} GB |")
    print(f"| stock autocast recipe (4 + 4 + 8, computed) | 16 | {16 * n / 1e9:.2f} GB |")
    print(f"\npeak RSS {peak / 1e9:.2f} GB ({peak / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
