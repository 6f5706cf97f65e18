"""RMSNorm speed in one process: PyTorch eager (torch.nn.functional.rms_norm),
torch.compile of the composite, and npukern's ops, forward and forward +
backward, on the seed's four shapes in bfloat16 and float32.

    python adapters/torch/bench.py [--reps N] [--dtypes bf16,f32]

Prints a Markdown table of median milliseconds (after one warm-up call, which
also compiles) and npukern's speed-up over eager."""

import argparse
import os
import statistics
import sys
import time

# Import the installed package, not the source tree this script sits beside.
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

import npukern_torch  # noqa: E402

SHAPES = [(1024, 1, 12288), (512, 4, 4096), (4, 2048, 5120), (2, 2048, 4096)]
DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32}
EPS = 1e-6


def composite(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def eager(x, w):
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS)


def npukern(x, w):
    return npukern_torch.rms_norm(x, w, EPS)[0]


def median_ms(fn, reps):
    fn()  # warm-up (and compilation)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def measure(impl, x, w, dy, reps):
    def fwd():
        with torch.no_grad():
            impl(x, w)

    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def fwd_bwd():
        xg.grad = wg.grad = None
        impl(xg, wg).backward(dy)

    return median_ms(fwd, reps), median_ms(fwd_bwd, reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", default="bf16,f32")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, npukern {npukern_torch.library_version} "
          f"({npukern_torch.detected_isa}), median of {args.reps}, ms")
    print()
    print("| dtype | x shape | eager fwd | compile fwd | npukern fwd | eager fwd+bwd | compile fwd+bwd "
          "| npukern fwd+bwd | speed-up fwd / fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for shape in SHAPES:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(shape, generator=g).to(dtype)
            w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
            dy = (0.1 * torch.randn(shape, generator=g)).to(dtype)
            # A fresh compilation per case (no recompile limit, no stale guards).
            torch._dynamo.reset()
            impls = {"eager": eager, "compile": torch.compile(composite, dynamic=False), "npukern": npukern}
            r = {k: measure(f, x, w, dy, args.reps) for k, f in impls.items()}
            e, c, n = r["eager"], r["compile"], r["npukern"]
            print(f"| {name} | {list(shape)} | {e[0]:.1f} | {c[0]:.1f} | {n[0]:.1f} | {e[1]:.1f} | {c[1]:.1f} "
                  f"| {n[1]:.1f} | {e[0] / n[0]:.1f}x / {e[1] / n[1]:.1f}x |", flush=True)
            del x, w, dy


if __name__ == "__main__":
    main()
