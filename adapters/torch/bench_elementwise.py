"""SwiGLU and RoPE speed in one process, at LLaMA shapes: a copy of the same
bytes (the memory floor: inputs read, outputs written), PyTorch eager of the
composite, torch.compile of it, and npukern's ops; forward, and backward
alone (the input gradients from saved inputs, as autograd calls it).

    python adapters/torch/bench_elementwise.py [--reps N] [--threads T]

SwiGLU: silu(gate) * up, gate/up [4096, 11008] and [4096, 14336] bfloat16
(backward: dgate, dup from dy, gate, up). RoPE: q and k [1, 32, 4096, 128]
bfloat16 with cos/sin [1, 1, 4096, 128] (backward: the transposed rotation).
Prints a Markdown table of median milliseconds and npukern's ratio to the copy
into a preallocated buffer and to a copy into a fresh one (what any op that
returns a new tensor pays: page faults on first touch of large outputs)."""

import argparse
import os
import statistics
import sys
import time

sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402

import npukern_torch  # noqa: E402
from npukern_torch import functional as F  # noqa: E402

ops = torch.ops.npukern


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def copy_of(read, write, fresh=False):
    """Reads `read` bytes and writes `write` bytes, as torch's copy does (one
    source buffer per output byte, the rest read by a sum-free second copy).
    `fresh`: into new outputs each call, as an op returning a new tensor does
    (torch.empty + copy_): large outputs come from mmap, so each call also
    pays the first-touch page faults npukern's and eager's ops pay."""
    src = torch.empty(write, dtype=torch.uint8)
    extra = torch.empty(max(read - write, 0), dtype=torch.uint8)
    kept = [torch.empty(write, dtype=torch.uint8), torch.empty(extra.numel() // 2, dtype=torch.uint8)]

    def run():
        dst, sink = [torch.empty_like(t) for t in kept] if fresh else kept
        dst.copy_(src)
        if extra.numel():
            # Reads the other input bytes (and writes half as many: a copy
            # cannot only read); counted as the floor's part.
            sink.copy_(extra[: sink.numel()])

    return run


def rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), dim=-1)


def swiglu_rows(reps):
    rows = []
    for n in (11008, 14336):
        g = torch.randn(4096, n).to(torch.bfloat16)
        u, dy = torch.randn_like(g), torch.randn_like(g)
        b = g.numel() * 2
        comp = torch.compile(lambda g, u: torch.nn.functional.silu(g) * u)

        def comp_bwd_fn(dy, g, u):
            s = torch.sigmoid(g.float())
            return ((dy.float() * u.float()) * s * (1 + g.float() * (1 - s))).to(g.dtype), \
                (dy.float() * g.float() * s).to(g.dtype)

        comp_bwd = torch.compile(comp_bwd_fn)
        fwd = {
            "copy": median_ms(copy_of(2 * b, b), reps),
            "fresh": median_ms(copy_of(2 * b, b, fresh=True), reps),
            "eager": median_ms(lambda: torch.nn.functional.silu(g) * u, reps),
            "compile": median_ms(lambda: comp(g, u), reps),
            "npukern": median_ms(lambda: ops.silu_mul(g, u, False), reps),
        }
        bwd = {
            "copy": median_ms(copy_of(3 * b, 2 * b), reps),
            "fresh": median_ms(copy_of(3 * b, 2 * b, fresh=True), reps),
            "eager": median_ms(lambda: comp_bwd_fn(dy, g, u), reps),
            "compile": median_ms(lambda: comp_bwd(dy, g, u), reps),
            "npukern": median_ms(lambda: ops.silu_mul_backward(dy, g, u, False), reps),
        }
        rows += [(f"SwiGLU fwd 4096x{n} bf16", fwd), (f"SwiGLU bwd 4096x{n} bf16", bwd)]
    # torch_npu's form: one input [2048, 22016], its halves gate and up
    # (npu_swiglu), against the eager composite a user writes for it.
    x = torch.randn(2048, 22016).to(torch.bfloat16)
    b = x.numel() * 2

    def eager_halves(x):
        a, u = x.chunk(2, -1)
        return torch.nn.functional.silu(a) * u

    comp = torch.compile(eager_halves)
    rows.append(("SwiGLU fwd x 2048x22016 bf16 (npu_swiglu)", {
        "copy": median_ms(copy_of(b, b // 2), reps),
        "fresh": median_ms(copy_of(b, b // 2, fresh=True), reps),
        "eager": median_ms(lambda: eager_halves(x), reps),
        "compile": median_ms(lambda: comp(x), reps),
        "npukern": median_ms(lambda: ops.swiglu(x), reps),
    }))
    return rows


def rope_rows(reps):
    q = torch.randn(1, 32, 4096, 128).to(torch.bfloat16)
    k = torch.randn_like(q)
    cos, sin = torch.randn(1, 1, 4096, 128).to(torch.bfloat16), torch.randn(1, 1, 4096, 128).to(torch.bfloat16)
    b = 2 * q.numel() * 2

    def composite(q, k, cos, sin):
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    comp = torch.compile(composite)
    rows = []
    for name, bwd in (("fwd", False), ("bwd", True)):
        row = {
            "copy": median_ms(copy_of(b, b), reps),
            "fresh": median_ms(copy_of(b, b, fresh=True), reps),
            "eager": median_ms(lambda: composite(q, k, cos, -sin if bwd else sin), reps),
            "compile": median_ms(lambda: comp(q, k, cos, -sin if bwd else sin), reps),
            "npukern": median_ms(lambda: ops.rope_qk(q, k, cos, sin, False, bwd), reps),
        }
        rows.append((f"RoPE {name} q,k 32x4096x128 bf16", row))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--swiglu-only", action="store_true", help="skip the RoPE rows")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), npukern ISA {npukern_torch.detected_isa}")
    print("| case | copy ms | fresh copy ms | eager ms | compile ms | npukern ms | npukern / copy "
          "| npukern / fresh copy | eager / npukern |")
    print("|---|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for name, r in swiglu_rows(a.reps) + (rope_rows(a.reps) if not a.swiglu_only else []):
            print(f"| {name} | {r['copy']:.2f} | {r['fresh']:.2f} | {r['eager']:.2f} | {r['compile']:.2f} | "
                  f"{r['npukern']:.2f} | {r['npukern'] / r['copy']:.2f} | {r['npukern'] / r['fresh']:.2f} | "
                  f"{r['eager'] / r['npukern']:.1f} |")


if __name__ == "__main__":
    main()
