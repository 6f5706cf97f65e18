"""What a user gains: a Llama-shaped bfloat16 training step (forward +
backward + clip + AdamW) of a Hugging Face LlamaForCausalLM, stock against
``npukern_torch.hf.patch``-ed, on 1 thread and on all threads; and the
per-call cost of a decode-sized norm (1 x 4096) through the op path against
the stock module. Prints a Markdown table; not a test.

    python adapters/torch/bench_hf.py [--hidden 2048] [--seq 1024] [--layers 2] [--steps 5]
"""

import argparse
import copy
import statistics
import time

import torch
import transformers as T

import npukern_torch
from npukern_torch import hf


def step_time(model, tokens, steps, clip):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for i in range(steps + 2):  # two warm-up steps
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        clip(model.parameters(), 1.0)
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def norm_call_us(module, x, reps=2000):
    with torch.no_grad():
        for _ in range(100):
            module(x)
        t0 = time.perf_counter()
        for _ in range(reps):
            module(x)
    return (time.perf_counter() - t0) / reps * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    h = args.hidden
    config = T.LlamaConfig(vocab_size=args.vocab, hidden_size=h, intermediate_size=h * 11 // 4,
                           num_hidden_layers=args.layers, num_attention_heads=h // 128, num_key_value_heads=h // 128,
                           max_position_embeddings=args.seq, attn_implementation="eager")
    torch.manual_seed(0)
    stock = T.LlamaForCausalLM(config).to(torch.bfloat16)
    patched = copy.deepcopy(stock)
    counts = hf.patch(patched)
    tokens = torch.randint(0, args.vocab, (1, args.seq))
    print(f"LlamaForCausalLM bf16: hidden {h}, {args.layers} layers, seq {args.seq}, vocab {args.vocab}; "
          f"patched {counts}; npukern ISA {npukern_torch.detected_isa}")
    print()
    print("| threads | stock step (s) | patched step (s) | speed-up |")
    print("|---|---|---|---|")
    all_threads = torch.get_num_threads()
    for threads in sorted({1, all_threads}):
        torch.set_num_threads(threads)
        s = step_time(stock, tokens, args.steps, torch.nn.utils.clip_grad_norm_)
        p = step_time(patched, tokens, args.steps, npukern_torch.clip_grad_norm_)
        print(f"| {threads} | {s:.3f} | {p:.3f} | {s / p:.2f}x |")
    print()
    print("| decode-sized norm, 1 x 4096 bf16 | us per call |")
    print("|---|---|")
    torch.set_num_threads(all_threads)
    x = torch.randn(1, 4096).to(torch.bfloat16)
    stock_norm = T.models.llama.modeling_llama.LlamaRMSNorm(4096).to(torch.bfloat16)
    ours = hf.HFRMSNorm.replacing(stock_norm, "llama")
    print(f"| stock LlamaRMSNorm (torch composite, 6 ops) | {norm_call_us(stock_norm, x):.1f} |")
    print(f"| npukern_torch (hf.patch-ed module, one op) | {norm_call_us(ours, x):.1f} |")
    print(f"| torch.ops.npukern.rms_norm alone | {norm_call_us(lambda t: torch.ops.npukern.rms_norm(t, ours.weight, 1e-6, 0.0, True), x):.1f} |")


if __name__ == "__main__":
    main()
