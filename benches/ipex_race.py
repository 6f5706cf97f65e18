"""npukern through PyTorch beside Intel Extension for PyTorch (IPEX) and
torch itself, in one process, every op called as a user calls it (the op
allocates its outputs; npukern's norms through npukern_torch's functional
forms, the README's calls, the others through torch.ops.npukern), against a
copy of the same bytes. Not a test: a
measurement. Run by benches/ipex_race.sh (its own venv: torch 2.8 + IPEX
2.8, npukern_torch built for that torch).

    python benches/ipex_race.py [--threads N] [--reps 9] [--resident]

--resident keeps freed blocks in glibc's heap (MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ set before the process starts: the script re-runs
itself), so every output lands on pages already written: the buffers a
training loop reuses. Without it, outputs above glibc's mmap threshold are
fresh pages, faulted during the call. Each sample is one call, except
at decode sizes: DECODE_LOOPS calls back to back, as a decode step makes
them (one call per layer). Prints a markdown table of medians
(ms) and npukern / IPEX. add_rms_norm has two rows per shape, each racing
the same outputs: "sum into the residual" (npukern's add_rms_norm_ beside
IPEX's add_back=True: y new, the sum over the residual) and "sum as a new
tensor" (npukern's add_rms_norm, the residual kept, beside the cheapest way
IPEX gives those outputs: the residual cloned, then add_back over the clone;
torch.add then IPEX's rms_norm measured 7% slower on Cascade Lake). The
large rms_norm / add_rms_norm rows also race npukern's C ABI called directly
(benches/capi_ctypes.py: libnpukern.so, its own thread pool; outputs
allocated by torch.empty as the other columns' are): "C ABI" with no page
hint, "C ABI hinted" with the store hint this caller knows (it just
allocated the outputs: NPK_OUTPUTS_FRESH, or with --resident
NPK_OUTPUTS_RESIDENT), add_rms_norm with the row's outputs.

--gap S sleeps S seconds before every sample: calls seconds apart, as a
training step makes a layer's large outputs. In a guest whose host takes
freed memory back (a virtio balloon with free page reporting: Firecracker,
QEMU), what a call's fresh pages cost depends on it (docs/performance.md
"Fresh pages in a guest"); NPK_TORCH_HUGE_PAGES=0/1 in the environment fixes
the adapter's choice of page size for its fresh outputs."""

import argparse
import os
import statistics
import sys
import time

DECODE_LOOPS = 200
RESIDENT_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 40), "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
                "MALLOC_TOP_PAD_": str(1 << 30)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--resident", action="store_true")
    ap.add_argument("--filter", default="")
    ap.add_argument("--gap", type=float, default=0.0)
    args = ap.parse_args()
    if args.resident and any(os.environ.get(k) != v for k, v in RESIDENT_ENV.items()):
        os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, **RESIDENT_ENV})

    import torch
    import intel_extension_for_pytorch as ipex
    import npukern_torch  # registers torch.ops.npukern; the norms' functional forms (the README's calls)

    torch.set_num_threads(args.threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import capi_ctypes

    capi = capi_ctypes.load()
    if capi is not None:
        capi.set_threads(args.threads)
    F = ipex.llm.functional
    nk = torch.ops.npukern
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=g).to(dtype)

    mode = "resident" if args.resident else "fresh"  # also the hinted C ABI's store hint

    def hinted(fn):
        def call():
            capi.set_pages(mode)
            try:
                return fn()
            finally:
                capi.set_pages(None)
        return call

    def with_capi(fns, rows, fn, hinted_fn=None):
        # Not at decode sizes: there ctypes' own cost (microseconds) is the figure.
        if capi is not None and rows > 8:
            fns["C ABI"] = fn
            fns["C ABI hinted"] = hinted(hinted_fn or fn)
        return fns

    def rms_case(rows, cols, dtype):
        x, w = rand(rows, cols, dtype=dtype), rand(cols, dtype=dtype)
        return with_capi({
            "copy": lambda: x.clone(),
            "npukern": lambda: npukern_torch.rms_norm(x, w, 1e-6),
            "ipex": lambda: F.rms_norm(x, w, 1e-6),
            "torch": lambda: torch.nn.functional.rms_norm(x, (cols,), w, 1e-6),
        }, rows, lambda: capi.rms_norm(x, w, 1e-6, torch))

    def add_rms_case(rows, cols, dtype, in_place):
        x, r, w = rand(rows, cols, dtype=dtype), rand(rows, cols, dtype=dtype), rand(cols, dtype=dtype)
        if in_place:
            # Both write the sum over their own copy of the residual (it grows by x
            # each call: the values stay finite over the reps).
            r2, r3, r4, r5 = r.clone(), r.clone(), r.clone(), r.clone()
            return with_capi({
                "copy": lambda: (x.clone(), r.clone()),
                "npukern": lambda: npukern_torch.add_rms_norm_(r3, x, w, 1e-6),
                "ipex": lambda: F.add_rms_norm(r2, x, w, None, 1e-6, True),
                "torch": lambda: torch.nn.functional.rms_norm(r5.add_(x), (cols,), w, 1e-6),
            }, rows, lambda: capi.add_rms_norm(r4, x, w, 1e-6, torch, in_place=True))

        def ipex_new_sum():  # y and the sum as new tensors, the residual kept
            s = r.clone()
            return F.add_rms_norm(s, x, w, None, 1e-6, True), s
        return with_capi({
            "copy": lambda: (x.clone(), r.clone()),
            "npukern": lambda: npukern_torch.add_rms_norm(x, r, w, 1e-6),
            "ipex": ipex_new_sum,
            "torch": lambda: torch.nn.functional.rms_norm(x + r, (cols,), w, 1e-6),
        }, rows, lambda: capi.add_rms_norm(x, r, w, 1e-6, torch))

    def silu_case(rows, cols, dtype):
        a, b = rand(rows, cols, dtype=dtype), rand(rows, cols, dtype=dtype)
        return {
            "copy": lambda: a.clone(),
            "npukern": lambda: nk.silu_mul(a, b, False),
            "ipex": lambda: F.silu_mul(a, b),
            "torch": lambda: torch.nn.functional.silu(a) * b,
        }

    def rope_case(tokens, hq, hk, d, dtype):
        # Llama's layout [batch, seq, heads, head_dim] and cos/sin [seq, head_dim]
        # in the activations' dtype (Hugging Face's); IPEX rotates in place.
        q, k = rand(1, tokens, hq, d, dtype=dtype), rand(1, tokens, hk, d, dtype=dtype)
        cos, sin = rand(tokens, d, dtype=dtype), rand(tokens, d, dtype=dtype)
        c4, s4 = cos.view(1, tokens, 1, d), sin.view(1, tokens, 1, d)

        def rotate_half(x):
            a, b = x.chunk(2, -1)
            return torch.cat((-b, a), -1)
        return {
            "copy": lambda: (q.clone(), k.clone()),
            "npukern": lambda: nk.rope_qk(q, k, c4, s4, True, False),
            "ipex": lambda: F.rotary_embedding(q, k, sin, cos, d, True),
            "torch": lambda: (q * c4 + rotate_half(q) * s4, k * c4 + rotate_half(k) * s4),
        }

    def attention_case(tokens, hq, hk, d, dtype):
        # Causal self-attention's forward, Llama's [batch, seq, heads, head_dim]
        # activations: npukern and torch read their per-head views in place
        # (grouped-query heads: torch with enable_gqa); IPEX's only attention,
        # varlen_attention (inference: no backward), takes [tokens, heads,
        # head_dim] and a caller's output, allocated per call as the others'.
        q, k, v = rand(tokens, hq, d, dtype=dtype), rand(tokens, hk, d, dtype=dtype), rand(tokens, hk, d, dtype=dtype)
        q4, k4, v4 = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))
        cu = torch.tensor([0, tokens], dtype=torch.int32)
        scale = d ** -0.5

        def ipex_attention():
            out = torch.empty_like(q)
            F.varlen_attention(q, k, v, out, cu, cu, None, tokens, tokens, 0.0, scale, False, True, False, None)
            return out
        return {
            "copy": lambda: q.clone(),
            "npukern": lambda: nk.attention(q4, k4, v4, True),
            "ipex": ipex_attention,
            "torch": lambda: torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True,
                                                                              enable_gqa=hq != hk),
        }

    cases = [
        ("rms_norm 4096x4096 f32", rms_case(4096, 4096, torch.float32)),
        ("rms_norm 2048x5120 f32", rms_case(2048, 5120, torch.float32)),
        ("rms_norm 16384x1024 f32", rms_case(16384, 1024, torch.float32)),
        ("rms_norm 4096x4096 bf16", rms_case(4096, 4096, torch.bfloat16)),
        ("rms_norm 1024x12288 bf16", rms_case(1024, 12288, torch.bfloat16)),
        ("rms_norm 8x4096 bf16 (decode)", rms_case(8, 4096, torch.bfloat16)),
        ("rms_norm 1x4096 bf16 (decode)", rms_case(1, 4096, torch.bfloat16)),
        *[(f"add_rms_norm {shape}, sum {into}", add_rms_case(rows, 4096, dtype, into == "into the residual"))
          for shape, rows, dtype in (("4096x4096 bf16", 4096, torch.bfloat16), ("4096x4096 f32", 4096, torch.float32),
                                     ("1x4096 bf16 (decode)", 1, torch.bfloat16))
          for into in ("into the residual", "as a new tensor")],
        ("silu_mul 4096x14336 f32", silu_case(4096, 14336, torch.float32)),
        ("silu_mul 4096x14336 bf16", silu_case(4096, 14336, torch.bfloat16)),
        ("silu_mul 8x14336 bf16 (decode)", silu_case(8, 14336, torch.bfloat16)),
        ("rope q32/k8 x128, 4096 tokens bf16", rope_case(4096, 32, 8, 128, torch.bfloat16)),
        ("rope q32/k8 x128, 4096 tokens f32", rope_case(4096, 32, 8, 128, torch.float32)),
        ("rope q32/k8 x128, 1 token bf16 (decode)", rope_case(1, 32, 8, 128, torch.bfloat16)),
        ("attention forward q16/k4 x64, 512 tokens causal bf16", attention_case(512, 16, 4, 64, torch.bfloat16)),
        ("attention forward q32/k8 x128, 2048 tokens causal bf16",
         attention_case(2048, 32, 8, 128, torch.bfloat16)),
        ("attention forward q32/k8 x128, 2048 tokens causal f32", attention_case(2048, 32, 8, 128, torch.float32)),
    ]
    print(f"torch {torch.__version__}, IPEX {ipex.__version__}, npukern {npukern_torch.library_version} "
          f"({npukern_torch.detected_isa}), {args.threads} thread(s), outputs {mode}, medians of {args.reps} (ms)"
          f"{f', {args.gap:g} s before each sample' if args.gap else ''}, "
          f"NPK_TORCH_HUGE_PAGES={os.environ.get('NPK_TORCH_HUGE_PAGES', 'unset')}\n")
    print("| case | copy | npukern | C ABI | C ABI hinted | IPEX | torch | npukern / IPEX | C ABI / IPEX "
          "| hinted / IPEX |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, fns in cases:
        if args.filter not in name:
            continue
        # Decode rows time DECODE_LOOPS back-to-back calls per sample (a
        # decode step calls each op once per layer): one call of a few
        # microseconds timed alone, right after another library's, measured
        # the cold caches and the timer as much as the op (one 8x4096 row
        # read 0.58 in one run and 1.04 in the next).
        loops = DECODE_LOOPS if "(decode)" in name else 1
        for fn in fns.values():  # warm-up (and, resident, the heap grows once)
            fn()
        times = {k: [] for k in fns}
        for rep in range(args.reps):
            order = list(fns.items())
            order = order[rep % len(order):] + order[:rep % len(order)]  # rotate who goes first
            for k, fn in order:
                if args.gap:
                    time.sleep(args.gap)
                t = time.perf_counter()
                for _ in range(loops):
                    out = fn()
                times[k].append((time.perf_counter() - t) / loops)
                del out
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}

        def opt(k):  # a column some rows have: (ms, ratio to IPEX) or blanks
            v = med.get(k)
            return ("", "") if v is None else (f"{v:.3f}", f"{v / med['ipex']:.2f}")

        (c_ms, c_ratio), (h_ms, h_ratio) = opt("C ABI"), opt("C ABI hinted")
        print(f"| {name} | {med['copy']:.3f} | {med['npukern']:.3f} | {c_ms} | {h_ms} | {med['ipex']:.3f} "
              f"| {med['torch']:.3f} | {med['npukern'] / med['ipex']:.2f} | {c_ratio} | {h_ratio} |")


if __name__ == "__main__":
    main()
