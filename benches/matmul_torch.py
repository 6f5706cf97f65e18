"""npukern's matmul through PyTorch against torch's own, on the training
step's products: per projection shape (tokens M, in K, out N) the forward
``x W^T``, the input gradient ``dy W`` and the weight gradient ``dy^T x``,
each as the patched Linear runs it (``torch.ops.npukern.matmul`` with the
stored operands, their trans flags and the route's math: the bf16 pair dot
where ``route.matmul_math`` picks it) and as torch's autograd does
(``torch.mm`` of the same views), in every dtype; the median of ``--reps``
calls after a warm-up, GFLOP/s, and the ratio. Also what
``npukern_torch.route`` decides for each dtype on this CPU.

    taskset -c 1 python benches/matmul_torch.py --threads 1
    taskset -c 1 python benches/matmul_torch.py --dtypes bf16 --shapes 512x1024x2816
    ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python benches/matmul_torch.py --clock thread   # torch without AMX
"""

import argparse
import statistics
import time

import torch

import npukern_torch
from npukern_torch import route

ops = torch.ops.npukern
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


CLOCK = time.perf_counter


def timed(f, reps):
    f()
    ts = []
    for _ in range(reps):
        t0 = CLOCK()
        f()
        ts.append(CLOCK() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    ap.add_argument("--shapes", nargs="+", default=["512x1024x2816", "512x2816x1024", "512x1024x1024"],
                    help="MxKxN: tokens x in_features x out_features")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="thread: this thread's CPU time (one thread only: on a machine busy with other work "
                         "it counts only this process's own time slices)")
    args = ap.parse_args()
    if args.clock == "thread":
        if args.threads != 1:
            ap.error("--clock thread times one thread: pass --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, npukern ISA "
          f"{npukern_torch.detected_isa}, {torch.get_num_threads()} thread(s)")
    for dt, (takes, why) in route.explain().items():
        math = "bf16 pair dot" if route.matmul_math(dt) == route.BF16_DOT else "FMA chain"
        print(f"  route {dt}: {'npukern' if takes else 'torch'}, npukern's {math} ({why})")
    print(f"{'dtype':5} {'M x K x N':>16} {'product':8} {'torch ms':>9} {'GF/s':>6} {'npukern ms':>10} {'GF/s':>6} "
          f"{'npk/torch':>9}")
    for name in args.dtypes:
        dt = DTYPES[name]
        for shape in args.shapes:
            m, k, n = (int(v) for v in shape.split("x"))
            g = torch.Generator().manual_seed(0)
            x = torch.randn(m, k, generator=g).to(dt)
            w = (torch.randn(n, k, generator=g) * 0.05).to(dt)
            dy = torch.randn(m, n, generator=g).to(dt)
            mm = route.matmul_math(dt)
            cases = {
                "x W^T": (lambda: torch.mm(x, w.t()), lambda: ops.matmul(x, w, False, True, None, mm)),
                "dy W": (lambda: torch.mm(dy, w), lambda: ops.matmul(dy, w, False, False, None, mm)),
                "dy^T x": (lambda: torch.mm(dy.t(), x), lambda: ops.matmul(dy, x, True, False, None, mm)),
            }
            flop = 2.0 * m * k * n
            for label, (ref, ours) in cases.items():
                t_ref, t_ours = timed(ref, args.reps), timed(ours, args.reps)
                print(f"{name:5} {shape:>16} {label:8} {t_ref * 1e3:9.2f} {flop / t_ref / 1e9:6.1f} "
                      f"{t_ours * 1e3:10.2f} {flop / t_ours / 1e9:6.1f} {t_ours / t_ref:9.2f}")


if __name__ == "__main__":
    main()
