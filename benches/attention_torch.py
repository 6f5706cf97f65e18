"""Attention on one Llama layer's shapes, forward and backward, four ways:
torch's `F.scaled_dot_product_attention` (CPU flash attention), the same
under the math backend, Hugging Face's eager form (the scores materialized
by torch's `matmul`, softmax in float32), and npukern's
(`npukern_torch.functional.scaled_dot_product_attention`, on q, k, v that
are per-head views of `[B, S, H, D]` projections, as a patched Hugging Face
layer hands them over). Medians of --reps (docs/performance.md
"Attention").

    taskset -c 0 python benches/attention_torch.py [--heads 16 --kv-heads 4 --seq 512 --dim 64] [--dtype float32]"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    h, kv, s, d = a.heads, a.kv_heads, a.seq, a.dim
    g = torch.Generator().manual_seed(0)

    dt = getattr(torch, a.dtype)

    def rand(*shape):
        # [B, S, H, D] viewed per head, as a projection's output is.
        b, hh, ss, dd = shape
        return torch.randn(b, ss, hh, dd, generator=g).to(dt).transpose(1, 2).requires_grad_()

    q, k, v = rand(1, h, s, d), rand(1, kv, s, d), rand(1, kv, s, d)
    dy = torch.randn(1, h, s, d, generator=g).to(dt)
    mask = torch.full((s, s), float("-inf")).triu(1)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def math():
        with sdpa_kernel(SDPBackend.MATH):
            return sdpa()

    def eager():
        kk, vv = k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1)
        p = F.softmax(torch.matmul(q, kk.transpose(2, 3)) * d**-0.5 + mask, dim=-1, dtype=torch.float32)
        return torch.matmul(p.to(q.dtype), vv)

    ways = [("sdpa (flash)", sdpa), ("sdpa (math)", math), ("eager", eager)]
    try:
        from npukern_torch import functional as npk

        def npukern():
            return npk.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        ways.append(("npukern", npukern))
    except ImportError:
        print("(npukern_torch not installed: torch's alone)")
    print(f"torch {torch.__version__}, {a.threads} thread(s), heads {h}, kv heads {kv}, seq {s}, dim {d}, "
          f"{a.dtype}, causal")
    for name, f in ways:
        ts = []
        for r in range(a.reps + 2):
            t = time.perf_counter()
            f().backward(dy)
            ts.append(time.perf_counter() - t)
            q.grad = k.grad = v.grad = None
        print(f"{name:<14} forward + backward {statistics.median(ts[2:]) * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
