"""The per-call cost of npukern's PyTorch adapter at decode sizes (issue 32
item 3), beside ``torch.add`` of the same tensor, in one process. Not a test:
a measurement.

    ~/.cache/npukern/venv/bin/python benches/call_cost.py [--threads N] [--reps 9] [--loops 2000] [--filter S]

Each row is one callable run ``--loops`` times back to back
(time.perf_counter_ns around the loop); the rows of a group are interleaved
``--reps`` times and the table shows the median per call (us) and the
spread (min-max of the reps), then the median minus the group's
``torch.add(x, x)``. Rows:

- ``torch.ops.aten.add.Tensor``: torch.add's kernel called the way every
  ``torch.ops`` op is (what the ``op`` rows cannot avoid);
- ``op``: ``torch.ops.npukern.<op>`` with no input requiring grad (the
  Autograd key is still dispatched through: what a user's call costs);
- ``op below autograd``: the same under ``_AutoDispatchBelowAutograd`` (the
  CPU kernel and the dispatcher only);
- ``op, x requires grad``: the forward that records the graph (no backward);
- ``op, eager caller``: the same overload through npukern_torch's eager
  caller (``npukern_torch/_fast.py``: the dispatcher without the
  ``torch.ops`` door), what the functional forms and modules call;
  ``NPK_TORCH_FAST_CALL=0`` in the environment routes them back through
  ``torch.ops``;
- ``module no_grad`` / ``module grad``: the nn.Module's forward under
  ``torch.no_grad()`` and with its parameters requiring grad (forward only).

Run it on an idle machine; on shared cores compare medians of interleaved
rows, never single figures."""

import argparse
import platform
import statistics
import subprocess
import time

import torch

import npukern_torch
from npukern_torch import functional as F

ops = torch.ops.npukern


def cpu_name():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "unknown CPU"


class below_autograd:
    """The dispatcher below the Autograd key (the op's CPU kernel alone)."""

    def __enter__(self):
        self.guard = torch._C._AutoDispatchBelowAutograd()
        self.guard.__enter__()

    def __exit__(self, *exc):
        self.guard.__exit__(*exc)


class plain:
    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


def r(*shape, dtype=torch.bfloat16, grad=False):
    return torch.randn(*shape).to(dtype).requires_grad_(grad)


def groups():
    """(group name, [(row name, callable, context factory)]); the first row of
    each group is its torch.add baseline."""
    out = []
    for rows, dtype in ((1, torch.bfloat16), (1, torch.float32), (8, torch.bfloat16)):
        name = f"rms_norm {rows}x4096 {str(dtype).replace('torch.', '')}"
        x, xg, g = r(rows, 4096, dtype=dtype), r(rows, 4096, dtype=dtype, grad=True), r(4096, dtype=dtype)
        res = r(rows, 4096, dtype=dtype)
        m = npukern_torch.RMSNorm(4096, eps=1e-6, dtype=dtype)
        am = npukern_torch.AddRMSNorm(4096, eps=1e-6, dtype=dtype)
        out.append((name, [
            ("torch.add(x, x)", lambda x=x: torch.add(x, x), plain),
            # The door every torch.ops call goes through (the JIT argument
            # parser, a boxed call), for the same kernel as torch.add.
            ("torch.ops.aten.add.Tensor(x, x)", lambda x=x: torch.ops.aten.add.Tensor(x, x), plain),
            ("op", lambda x=x, g=g: ops.rms_norm(x, g, 1e-6), plain),
            ("op below autograd", lambda x=x, g=g: ops.rms_norm(x, g, 1e-6), below_autograd),
            ("op, x requires grad", lambda xg=xg, g=g: ops.rms_norm(xg, g, 1e-6), plain),
            # The same overload through npukern_torch's eager caller (_fast.py:
            # no torch.ops door), and the public function that uses it.
            ("op, eager caller", lambda x=x, g=g: F._rms_norm_op(x, g, 1e-6), plain),
            ("npukern_torch.rms_norm", lambda x=x, g=g: npukern_torch.rms_norm(x, g, 1e-6), plain),
            ("RMSNorm no_grad", lambda m=m, x=x: m(x), torch.no_grad),
            ("RMSNorm grad", lambda m=m, x=x: m(x), plain),
            ("add_rms_norm op", lambda x=x, res=res, g=g: ops.add_rms_norm(x, res, g, 1e-6), plain),
            ("add_rms_norm op, eager caller", lambda x=x, res=res, g=g: F._add_rms_norm_op(x, res, g, 1e-6), plain),
            ("AddRMSNorm no_grad", lambda am=am, x=x, res=res: am(x, res), torch.no_grad),
            ("AddRMSNorm grad", lambda am=am, x=x, res=res: am(x, res), plain),
        ]))
    # Llama-7B-like decode shapes: intermediate 11008, 32 q / 8 kv heads of 128, vocab 32000.
    gate, up = r(1, 11008), r(1, 11008)
    gu = r(1, 22016)
    gateg = r(1, 11008, grad=True)
    out.append(("swiglu / silu_mul 1x11008 bfloat16", [
        ("torch.add(gate, gate)", lambda: torch.add(gate, gate), plain),
        ("silu_mul op", lambda: ops.silu_mul(gate, up), plain),
        ("silu_mul op below autograd", lambda: ops.silu_mul(gate, up), below_autograd),
        ("silu_mul op, eager caller", lambda: F._silu_mul_op(gate, up), plain),
        ("silu_mul op, gate requires grad", lambda: ops.silu_mul(gateg, up), plain),
        ("F.silu_mul", lambda: F.silu_mul(gate, up), plain),
        ("swiglu op (x 1x22016)", lambda: ops.swiglu(gu), plain),
        ("torch: silu(gate) * up", lambda: torch.nn.functional.silu(gate) * up, plain),
    ]))
    q, k = r(1, 32, 1, 128), r(1, 8, 1, 128)
    qg = r(1, 32, 1, 128, grad=True)
    cos, sin = r(1, 1, 1, 128), r(1, 1, 1, 128)
    cos3, sin3 = r(1, 1, 128), r(1, 1, 128)
    out.append(("rope q 1x32x1x128, k 1x8x1x128 bfloat16", [
        ("torch.add(q, q)", lambda: torch.add(q, q), plain),
        ("rotary_mul op", lambda: ops.rotary_mul(q, cos, sin), plain),
        ("rotary_mul op below autograd", lambda: ops.rotary_mul(q, cos, sin), below_autograd),
        ("rotary_mul op, eager caller", lambda: F._rotary_mul_op(q, cos, sin), plain),
        ("rotary_mul op, q requires grad", lambda: ops.rotary_mul(qg, cos, sin), plain),
        ("rope_qk op", lambda: ops.rope_qk(q, k, cos, sin), plain),
        ("F.apply_rotary_pos_emb", lambda: F.apply_rotary_pos_emb(q, k, cos3, sin3), plain),
    ]))
    logits = r(1, 32000, dtype=torch.float32)
    logitsg = r(1, 32000, dtype=torch.float32, grad=True)
    target = torch.tensor([7])
    out.append(("cross_entropy 1x32000 float32", [
        ("torch.add(logits, logits)", lambda: torch.add(logits, logits), plain),
        ("cross_entropy op", lambda: ops.cross_entropy(logits, target), plain),
        ("cross_entropy op below autograd", lambda: ops.cross_entropy(logits, target), below_autograd),
        ("cross_entropy op, logits require grad", lambda: ops.cross_entropy(logitsg, target), plain),
        ("npukern_torch.cross_entropy", lambda: npukern_torch.cross_entropy(logits, target), plain),
        ("torch F.cross_entropy", lambda: torch.nn.functional.cross_entropy(logits, target), plain),
    ]))
    weight = r(32000, 4096)
    emb = npukern_torch.Embedding(32000, 4096, _weight=weight.clone())
    tok = torch.tensor([[11]])
    row = r(1, 1, 4096)
    out.append(("embedding 32000x4096 bfloat16, 1 token", [
        ("torch.add(row, row)", lambda: torch.add(row, row), plain),
        ("embedding op", lambda: ops.embedding(weight, tok), plain),
        ("embedding op below autograd", lambda: ops.embedding(weight, tok), below_autograd),
        ("Embedding no_grad", lambda: emb(tok), torch.no_grad),
        ("Embedding grad", lambda: emb(tok), plain),
        ("torch F.embedding", lambda: torch.nn.functional.embedding(tok, weight), plain),
    ]))
    return out


def per_call_ns(fn, ctx, loops):
    with ctx():
        start = time.perf_counter_ns()
        for _ in range(loops):
            fn()
        return (time.perf_counter_ns() - start) / loops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--loops", type=int, default=2000)
    ap.add_argument("--filter", default="", help="only groups whose name contains this")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"npukern {npukern_torch.library_version} ({npukern_torch.detected_isa}); "
          f"median of {args.reps} interleaved reps of {args.loops} calls")
    print()
    print("| group | call | us / call | spread | - torch.add |")
    print("|---|---|---:|---:|---:|")
    for name, rows in groups():
        if args.filter not in name:
            continue
        for _, fn, ctx in rows:  # warm up (first calls allocate, load, plan)
            per_call_ns(fn, ctx, max(1, args.loops // 10))
        samples = [[] for _ in rows]
        for _ in range(args.reps):
            for i, (_, fn, ctx) in enumerate(rows):
                samples[i].append(per_call_ns(fn, ctx, args.loops))
        base = statistics.median(samples[0])
        for i, (row, _, _) in enumerate(rows):
            med = statistics.median(samples[i])
            spread = f"{min(samples[i]) / 1e3:.2f}-{max(samples[i]) / 1e3:.2f}"
            delta = "" if i == 0 else f"{(med - base) / 1e3:+.2f}"
            print(f"| {name if i == 0 else ''} | {row} | {med / 1e3:.2f} | {spread} | {delta} |", flush=True)


if __name__ == "__main__":
    main()
