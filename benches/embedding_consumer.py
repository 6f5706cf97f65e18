"""The embedding gradient through PyTorch, timed with what consumes it.

Few indices into a large table: npukern's op maps the table from the OS as
zeros and writes only the rows it hits, so its cost moves to whoever first
writes the rest. torch's own `clip_grad_norm_` (which every `hf.patch` user
on torch's optimizer runs) scales every gradient in place with `mul_`: that
is the consumer here. Per shape, medians of interleaved samples (ms): the op
alone, the op then `grad.mul_(0.5)`, for npukern
(`torch.ops.npukern.embedding_dense_backward`) and aten
(`torch.ops.aten.embedding_dense_backward`), beside `torch.zeros` of the
table (+ the same `mul_`), the floor of a dense answer.

Run: taskset -c 0 python benches/embedding_consumer.py [--reps 9] [--threads 1]
"""

import argparse
import statistics
import time

import torch

import npukern_torch  # noqa: F401  registers torch.ops.npukern

SHAPES = [  # (table rows, hidden, positions): the batch's ids into the vocabulary
    (32000, 2048, 1024),
    (32000, 4096, 2048),
    (152064, 1536, 4096),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, npukern {npukern_torch.library_version} ({npukern_torch.detected_isa}), "
          f"{args.threads} thread(s), bf16, medians of {args.reps} (ms)\n")
    print("| table x hidden, positions | npukern | npukern + mul_ | aten | aten + mul_ | zeros | zeros + mul_ "
          "| + mul_: npukern / aten |")
    print("|---|---|---|---|---|---|---|---|")
    for v, h, n in SHAPES:
        grad = torch.randn(n, h, generator=g).to(torch.bfloat16)
        idx = torch.randint(0, v, (n,), generator=g)
        ops = {
            "npukern": lambda: torch.ops.npukern.embedding_dense_backward(grad, idx, v, -1, False),
            "aten": lambda: torch.ops.aten.embedding_dense_backward(grad, idx, v, -1, False),
            "zeros": lambda: torch.zeros(v, h, dtype=torch.bfloat16),
        }
        cases = [(name, consumer) for name in ops for consumer in (False, True)]
        times = {c: [] for c in cases}
        for c in cases:  # warm-up
            ops[c[0]]()
        for rep in range(args.reps):
            order = cases[rep % len(cases):] + cases[:rep % len(cases)]  # rotate who goes first
            for name, consumer in order:
                t = time.perf_counter()
                out = ops[name]()
                if consumer:
                    out.mul_(0.5)
                times[(name, consumer)].append(time.perf_counter() - t)
                del out
        med = {c: statistics.median(ts) * 1e3 for c, ts in times.items()}
        cells = " | ".join(f"{med[c]:.1f}" for c in cases)
        print(f"| {v} x {h}, {n} | {cells} | {med[('npukern', True)] / med[('aten', True)]:.2f} |")


if __name__ == "__main__":
    main()
