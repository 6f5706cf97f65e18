"""The AdamW step pass against a copy of the same bytes and torch's fused
AdamW, in one process on the threads given (pin with taskset):

    taskset -c 0 python bench_optim.py --threads 1 --numel 16000000

Rows: npukern (bf16 params, f32 masters and moments, bf16 grads), the same
with max_grad_norm (clip + step: two reads of the gradients), npukern and
torch fused on float32 params; each beside `dst.copy_(src)` of the bytes the
step reads (and writes back). Every row and copy interleaved rep by rep,
medians of --reps. With --deepspeed, also
DeepSpeed's CPU Adam (`DeepSpeedCPUAdam`, AdamW mode, float32 params; needs
`pip install deepspeed`, whose CPUAdam extension builds on first use and
needs `ninja` on PATH: run with the venv's `bin` first on PATH). With --ipex
(in the venv of benches/ipex_race.sh: torch 2.8 + IPEX 2.8), also what
`ipex.optimize(model, optimizer=torch.optim.AdamW(...), dtype=torch.bfloat16)`
steps: bf16 weights with float32 masters (IPEX 2.8 has no fused AdamW on
CPU: it warns and runs torch's AdamW on the masters, then copies them to
the bf16 weights)."""

import argparse
import statistics
import time

import torch

import npukern_torch  # noqa: F401
from npukern_torch.optim import AdamW


def interleaved_ms(fns, reps):
    """Median ms of each callable, the callables interleaved rep by rep
    (rotating who goes first): this VM's bandwidth drifts by tens of
    percent within a minute, so rows timed one after the other compare
    the moments they ran in as much as the code."""
    for f in fns.values():
        f()
    ts = {k: [] for k in fns}
    items = list(fns.items())
    for r in range(reps):
        for k, f in items[r % len(items):] + items[:r % len(items)]:
            t = time.perf_counter()
            f()
            ts[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) * 1e3 for k, v in ts.items()}


def deepspeed_adam(ps):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(ps, lr=1e-4, adamw_mode=True, weight_decay=0.01)


def ipex_adamw(n):
    """IPEX's bf16 recipe on a Linear of ~n weights (`ipex.optimize` acts on
    modules), its gradients made by one backward and kept."""
    import intel_extension_for_pytorch as ipex

    side = int(n**0.5)
    m = torch.nn.Linear(side, side, bias=False)
    m, o = ipex.optimize(m, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-4), dtype=torch.bfloat16)
    m(torch.randn(4, side).bfloat16()).float().sum().backward()
    return o.step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--numel", type=int, default=16_000_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--deepspeed", action="store_true", help="add DeepSpeedCPUAdam's row")
    ap.add_argument("--ipex", action="store_true", help="add IPEX's bf16 AdamW row (ipex.optimize)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    n = a.numel
    fns, floors = {}, {}

    def copy_fn(nbytes):
        src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
        dst = torch.empty_like(src).zero_()
        return lambda: dst.copy_(src)

    # bf16 params + f32 masters/moments: reads grad 2 + master 4 + m 4 + v 4,
    # writes param 2 + master 4 + m 4 + v 4 bytes per element.
    for clip in (None, 1.0):
        p = torch.nn.Parameter(torch.randn(n).bfloat16())
        p.grad = (torch.randn(n) * 1e-3).bfloat16()
        o = AdamW([p], lr=1e-4, master_weights=True, max_grad_norm=clip)
        name = f"npukern bf16+master{' +clip' if clip else ''}"
        fns[name] = o.step
        floors[name] = f"copy {14 + (2 if clip else 0)} B"
    if a.ipex:
        fns["ipex bf16+master"] = ipex_adamw(n)
        floors["ipex bf16+master"] = "copy 14 B"
    for name, make in (
        ("npukern f32", lambda ps: AdamW(ps, lr=1e-4)),
        ("torch fused f32", lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True)),
    ) + ((("deepspeed cpu_adam f32", deepspeed_adam),) if a.deepspeed else ()):
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n) * 1e-3
        fns[name] = make([p]).step
        floors[name] = "copy 16 B"
    for b in (14, 16):
        fns[f"copy {b} B"] = copy_fn(b * n)
    ms = interleaved_ms(fns, a.reps)
    rows = [(k, ms[k], ms[floors[k]]) for k in floors]
    print(f"{n} elements, {a.threads} thread(s), torch {torch.__version__}, npukern ISA {npukern_torch.detected_isa}")
    print(f"{'row':<28} {'ms':>8} {'copy ms':>8} {'ratio':>6}")
    for name, t, c in rows:
        print(f"{name:<28} {t:8.2f} {c:8.2f} {t / c:6.2f}")
    f32 = {r[0]: r[1] for r in rows}
    print(f"npukern f32 / torch fused f32: {f32['npukern f32'] / f32['torch fused f32']:.2f}")
    if a.ipex:
        print(f"npukern bf16+master / ipex bf16+master: {f32['npukern bf16+master'] / f32['ipex bf16+master']:.2f}")
    if a.deepspeed:
        print(f"npukern f32 / deepspeed cpu_adam f32: {f32['npukern f32'] / f32['deepspeed cpu_adam f32']:.2f}")


if __name__ == "__main__":
    main()
