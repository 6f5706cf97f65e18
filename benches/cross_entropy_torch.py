"""Cross-entropy through PyTorch, as a user calls it.

1. Speed (one process, interleaved, medians): forward + backward of
   ``npukern_torch.cross_entropy(logits, target)`` against torch's
   ``F.cross_entropy(logits.float(), target)`` (what Hugging Face runs) and
   against a same-bytes copy (the kernel reads the logits twice and writes
   their gradient once: a ``copy_`` of 1.5x the logits' bytes), one thread
   and all threads. The gradients are fresh tensors, as autograd makes them.
2. Memory (one process per variant): the fused linear cross-entropy
   (``npukern_torch.linear_cross_entropy``) against stock
   (``F.cross_entropy((hidden @ weight.T).float(), target)``), forward and
   backward, bf16, peak resident memory above the inputs (``ru_maxrss``
   minus the RSS once hidden and weight exist), and the time.

Run: python benches/cross_entropy_torch.py [--speed] [--memory] [--reps 7] [--case 4096x32000]
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SPEED_CASES = [(4096, 32000, torch.bfloat16), (8192, 32000, torch.bfloat16), (4096, 128256, torch.bfloat16),
               (8192, 32000, torch.float32)]
MEMORY_CASES = [(8192, 2048, 50000), (8192, 2048, 128256)]


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def speed(reps, threads, only=None):
    import npukern_torch

    torch.set_num_threads(threads)
    print(f"\n## forward + backward, {threads} thread(s) (medians of {reps}, ms)")
    print(f"{'case':28} {'copy 1.5x':>10} {'npukern':>10} {'torch':>10} {'npk/copy':>9} {'npk/torch':>10}")
    for n, c, dtype in SPEED_CASES:
        if only and only not in f"{n}x{c} {str(dtype).replace('torch.', '')}":
            continue
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(n, c, generator=g) * 3).to(dtype).requires_grad_()
        target = torch.randint(0, c, (n,), generator=g)
        src = torch.empty(n * c * logits.element_size() * 3 // 2, dtype=torch.uint8).fill_(1)
        dst = torch.zeros_like(src)

        def npk():
            npukern_torch.cross_entropy(logits, target).backward()
            logits.grad = None

        def stock():
            F.cross_entropy(logits.float(), target).backward()
            logits.grad = None

        runs = {"copy": [], "npk": [], "torch": []}
        for fn in (npk, stock):
            fn()  # warm-up
        for _ in range(reps):
            runs["copy"].append(timed(lambda: dst.copy_(src)))
            runs["npk"].append(timed(npk))
            runs["torch"].append(timed(stock))
        m = {k: statistics.median(v) * 1e3 for k, v in runs.items()}
        name = f"{n}x{c} {str(dtype).replace('torch.', '')}"
        print(f"{name:28} {m['copy']:10.1f} {m['npk']:10.1f} {m['torch']:10.1f} {m['npk'] / m['copy']:9.2f} "
              f"{m['npk'] / m['torch']:10.2f}")


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(variant, n, hidden, vocab):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(n, hidden, generator=g) * 0.5).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, vocab, (n,), generator=g)
    base = rss_bytes()
    t0 = time.perf_counter()
    if variant == "fused":
        import npukern_torch

        loss = npukern_torch.linear_cross_entropy(x, w, t)
    else:
        loss = F.cross_entropy((x @ w.t()).float(), t)
    loss.backward()
    ms = (time.perf_counter() - t0) * 1e3
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"extra_mib": (peak - base) / 2**20, "ms": ms, "loss": loss.item()}))


def memory():
    print(f"\n## fused linear cross-entropy vs stock, bf16, forward + backward, {torch.get_num_threads()} thread(s)")
    print(f"{'tokens x hidden x vocab':26} {'stock MiB':>10} {'fused MiB':>10} {'fused/stock':>12} {'stock ms':>9} "
          f"{'fused ms':>9} {'loss diff':>10}")
    for n, hidden, vocab in MEMORY_CASES:
        out = {}
        for variant in ("stock", "fused"):
            p = subprocess.run([sys.executable, __file__, "--memory-child", variant, str(n), str(hidden), str(vocab)],
                               check=True, capture_output=True, text=True)
            out[variant] = json.loads(p.stdout.strip().splitlines()[-1])
        s, f = out["stock"], out["fused"]
        print(f"{f'{n} x {hidden} x {vocab}':26} {s['extra_mib']:10.0f} {f['extra_mib']:10.0f} "
              f"{f['extra_mib'] / s['extra_mib']:12.3f} {s['ms']:9.0f} {f['ms']:9.0f} "
              f"{abs(f['loss'] - s['loss']) / abs(s['loss']):10.1e}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speed", action="store_true")
    p.add_argument("--memory", action="store_true")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--case", help="only the speed cases whose 'NxC dtype' contains this")
    p.add_argument("--memory-child", nargs=4, metavar=("VARIANT", "N", "HIDDEN", "VOCAB"))
    args = p.parse_args()
    if args.memory_child:
        v, n, h, c = args.memory_child
        return memory_child(v, int(n), int(h), int(c))
    both = not (args.speed or args.memory)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    if args.speed or both:
        for threads in sorted({1, os.cpu_count()}):
            speed(args.reps, threads, args.case)
    if args.memory or both:
        memory()


if __name__ == "__main__":
    main()
