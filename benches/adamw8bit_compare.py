"""npukern's 8-bit AdamW moments beside bitsandbytes' and torchao's (issue 56).

Two measurements, each variant in its own process (``taskset -c 1`` the
caller's business; one torch thread unless --threads):

1. The small recipe of ``benches/loss_curve.py`` (a Llama from transformers,
   hidden 256, 2 layers, seq 128, batch 8, vocab 512, a Markov-chain
   synthetic corpus, lr 3e-4, weight decay 0.01, clip 1.0, fixed seeds)
   trained --steps steps per variant:

   - ``npukern_master_f32`` (the reference): the model in bf16,
     ``hf.patch``-ed, ``npukern_torch.optim.AdamW(master_weights=True,
     max_grad_norm=1.0)``;
   - ``npukern_split_int8``: the same with ``master_weights="split",
     state_dtype="int8"``;
   - ``bnb_adamw8bit``: ``bitsandbytes.optim.AdamW8bit`` on a float32 model
     under ``torch.autocast("cpu", torch.bfloat16)`` with
     ``clip_grad_norm_(1.0)`` (their usual recipe);
     ``bnb_adamw8bit_bf16``: the same optimizer on the patched bf16 model
     (bf16 params, no master: each update rounded to bf16 to nearest);
   - ``torchao_adamw8bit``: ``torchao.optim.AdamW8bit`` likewise (f32 model,
     autocast; its step is ``torch.compile``-d per param shape, the compile
     in the first steps); ``torchao_adamw8bit_bf16_sr``: on the patched bf16
     model with its ``bf16_stochastic_round=True``;
   - on request (``--variants``): ``torchao_adamw4bit``,
     ``bnb_paged_adamw8bit`` (the f32 autocast recipe; bnb's paged
     optimizer runs AdamW8bit's code on CPU).

   Prints the 10-step-mean losses every --every steps, each variant's
   difference to ``npukern_master_f32`` (%), the mean step time (whole step:
   forward, backward, clip, optimizer; steps after the first --warmup) and
   the optimizer's share (the process's CPU time too: robust to a core
   shared with other work), and the bytes of optimizer state per parameter
   counted from the optimizer's state tensors (masters, low halves, codes,
   scales, quantization maps, the float moments of small params; each
   storage once), beside the bytes of the params themselves.

2. The moments' error: npukern's float32 AdamW and each 8-bit optimizer fed
   the same gradient sequence (--msteps steps) on one float32 tensor of
   --mnumel elements, weight decay 0; each one's exp_avg / exp_avg_sq
   decoded (npukern: ``dequantize_moment``; bitsandbytes:
   ``functional.dequantize_blockwise`` with the state's absmax and qmap;
   torchao: the state subclass's ``dequantize()``) and the update direction
   ``u = (m / bc1) / (sqrt(v / bc2) + eps)`` compared with the float32 one:
   median and 99th percentile of ``|u - u_f32| / |u_f32|``, and the median
   relative error of m and v. Two gradient streams, both heavy-tailed:
   ``fixed`` (g = randn * exp(2 z), z drawn once per element: each element
   its own scale, as a network's params have) and ``fresh`` (z drawn anew
   every step).

    taskset -c 1 python benches/adamw8bit_compare.py [--steps 300]

``pip install bitsandbytes torchao``. A variant whose library is missing or
fails is reported with its error, the others run.
"""

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = ("npukern_master_f32", "npukern_split_int8", "bnb_adamw8bit", "bnb_adamw8bit_bf16", "torchao_adamw8bit",
            "torchao_adamw8bit_bf16_sr", "torchao_adamw4bit", "bnb_paged_adamw8bit")
# Run by default (the last two on request: --variants; bnb's paged optimizer
# on CPU runs the same code as AdamW8bit).
DEFAULT = VARIANTS[:6]
REF = "npukern_master_f32"
MOMENT_OPTS = ("npukern_int8", "npukern_bf16_state", "bnb_adamw8bit", "torchao_adamw8bit", "torchao_adamw4bit")


def state_bytes(opt):
    """Bytes of every tensor in the optimizer's state (tensor subclasses:
    their inner tensors), each storage once."""
    import torch

    seen, total = set(), 0

    def add(t):
        nonlocal total
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            names, _ = t.__tensor_flatten__()
            for n in names:
                add(getattr(t, n))
            return
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if key not in seen:
            seen.add(key)
            total += s.nbytes()

    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                add(v)
    return total


def make_opt(v, params, lr, wd):
    import torch

    if v.startswith("npukern"):
        from npukern_torch.optim import AdamW

        kw = dict(master_weights=True) if v == "npukern_master_f32" else dict(master_weights="split", state_dtype="int8")
        return AdamW(params, lr=lr, weight_decay=wd, max_grad_norm=1.0, **kw)
    if v.startswith("bnb"):
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if v == "bnb_paged_adamw8bit" else bnb.optim.AdamW8bit
        return cls(params, lr=lr, weight_decay=wd)
    if v.startswith("torchao"):
        from torchao.optim import AdamW4bit, AdamW8bit

        if v == "torchao_adamw4bit":
            return AdamW4bit(params, lr=lr, weight_decay=wd)
        return AdamW8bit(params, lr=lr, weight_decay=wd, bf16_stochastic_round=v.endswith("_sr"))
    raise ValueError(v)


def child(a):
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from loss_curve import model_and_batches  # the same model, init and corpus

    torch.set_num_threads(a.threads)
    model, batch = model_and_batches(a)

    v = a.child
    bf16 = v.startswith("npukern") or "_bf16" in v
    if bf16:
        from npukern_torch import hf

        model = model.to(torch.bfloat16)
        hf.patch(model)
    params = [p for p in model.parameters() if p.requires_grad]
    out = dict(variant=v, model_dtype=str(params[0].dtype), n_params=sum(p.numel() for p in params),
               param_bytes=sum(p.numel() * p.element_size() for p in params), losses=[], step_s=[], opt_s=[], cpu_s=[])
    try:
        opt = make_opt(v, params, a.lr, 0.01)
        for step in range(a.steps):
            x = batch(step)
            c0, t0 = time.process_time(), time.perf_counter()
            with torch.autocast("cpu", torch.bfloat16, enabled=not bf16):
                loss = model(x, labels=x).loss
            loss.backward()
            if not v.startswith("npukern"):
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            out["cpu_s"].append(time.process_time() - c0)
            out["losses"].append(loss.item())
            out["step_s"].append(t2 - t0)
            out["opt_s"].append(t2 - t1)
        out["state_bytes"] = state_bytes(opt)
    except Exception as e:  # a library without this path: say what it said
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        out["error_at_step"] = len(out["losses"])
    print(json.dumps(out))


def moments_child(a):
    """Every optimizer in MOMENT_OPTS and the float32 reference on the same
    gradients; prints the errors as JSON."""
    import torch

    torch.set_num_threads(a.threads)
    n, steps, lr, eps = a.mnumel, a.msteps, 1e-3, 1e-8
    b1, b2 = 0.9, 0.999
    z_fixed = torch.randn(n, generator=torch.Generator().manual_seed(7))

    def grad(kind, step):
        gs = torch.Generator().manual_seed(10_000 + step)
        z = z_fixed if kind == "fixed" else torch.randn(n, generator=gs)
        return torch.randn(n, generator=gs) * torch.exp(2 * z)

    def run(name, kind):
        from npukern_torch.optim import AdamW, dequantize_moment

        p = torch.nn.Parameter(torch.zeros(n))
        if name == "f32":
            opt = AdamW([p], lr=lr, eps=eps, weight_decay=0.0)
        elif name == "npukern_int8":
            opt = AdamW([p], lr=lr, eps=eps, weight_decay=0.0, state_dtype="int8")
        elif name == "npukern_bf16_state":
            opt = AdamW([p], lr=lr, eps=eps, weight_decay=0.0, state_dtype=torch.bfloat16)
        else:
            opt = make_opt(name, [p], lr, 0.0)
        t = 0.0
        for s in range(steps):
            p.grad = grad(kind, s)
            t0 = time.perf_counter()
            opt.step()
            t += time.perf_counter() - t0 if s else 0.0
        st = opt.state[p]
        if name.startswith("npukern_int8"):
            m = dequantize_moment(st["exp_avg"], st["exp_avg_scale"], True)
            v = dequantize_moment(st["exp_avg_sq"], st["exp_avg_sq_scale"], False)
        elif name.startswith("bnb"):
            import bitsandbytes.functional as F

            m = F.dequantize_blockwise(st["state1"], absmax=st["absmax1"], code=st["qmap1"], blocksize=256)
            v = F.dequantize_blockwise(st["state2"], absmax=st["absmax2"], code=st["qmap2"], blocksize=256)
        elif name.startswith("torchao"):
            m, v = st["exp_avg"].dequantize(), st["exp_avg_sq"].dequantize()
        else:
            m, v = st["exp_avg"], st["exp_avg_sq"]
        return m.float().reshape(-1), v.float().reshape(-1), t / max(1, steps - 1), state_bytes(opt) / n

    res = []
    for kind in ("fixed", "fresh"):
        m0, v0, _, _ = run("f32", kind)
        bc1, bc2 = 1 - b1 ** steps, 1 - b2 ** steps
        u0 = (m0 / bc1) / ((v0 / bc2).sqrt() + eps)
        for name in MOMENT_OPTS:
            row = dict(kind=kind, opt=name)
            try:
                m, v, t, bpp = run(name, kind)
                u = (m / bc1) / ((v / bc2).sqrt() + eps)
                ru = ((u - u0).abs() / u0.abs()).double()
                rm = ((m - m0).abs() / m0.abs()).double()
                rv = ((v - v0).abs() / v0.abs()).double()
                q = torch.tensor([0.5, 0.99], dtype=torch.float64)
                qu = torch.quantile(ru[torch.isfinite(ru)][:: max(1, n // 1_000_000)], q)  # quantile's input limit
                row.update(u_med=qu[0].item(), u_p99=qu[1].item(), m_med=rm.median().item(), v_med=rv.median().item(),
                           v_zero=(v == 0).double().mean().item(), sign_flip=((u * u0) < 0).double().mean().item(),
                           step_ms=1e3 * t, bytes_per_elem=bpp)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            res.append(row)
    print(json.dumps(res))


def versions():
    import importlib.metadata as md

    out = {}
    for pkg in ("torch", "transformers", "bitsandbytes", "torchao", "npukern_torch"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def cpu_name():
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from loss_curve import print_loss_tables, recipe_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    recipe_args(p)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the mean step time (torchao compiles)")
    p.add_argument("--mnumel", type=int, default=1 << 20)
    p.add_argument("--msteps", type=int, default=100)
    p.add_argument("--variants", default=",".join(DEFAULT))
    p.add_argument("--no-moments", action="store_true")
    p.add_argument("--child", choices=VARIANTS + ("moments",))
    a = p.parse_args()
    if a.child == "moments":
        return moments_child(a)
    if a.child:
        return child(a)
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    args = list(sys.argv[1:])
    t_start = time.time()

    def spawn(name):
        r = subprocess.run([sys.executable, __file__, *args, "--child", name], capture_output=True, text=True)
        lines = r.stdout.strip().splitlines()
        if r.returncode != 0 or not lines:
            tail = " / ".join(r.stderr.strip().splitlines()[-3:])
            return None, f"exit {r.returncode}: {tail[:400]}"
        return json.loads(lines[-1]), None

    runs = {}
    for v in variants:
        out, err = spawn(v)
        runs[v] = out if out is not None else dict(variant=v, error=err, losses=[])
    print(f"CPU: {cpu_name()}; {a.threads} torch thread(s); versions: "
          + ", ".join(f"{k} {v}" for k, v in versions().items()))
    print(f"Llama hidden {a.hidden}, {a.layers} layers, seq {a.seq} x batch {a.batch}, vocab {a.vocab}, lr {a.lr}, "
          f"wd 0.01, clip 1.0, {a.steps} steps; loss averaged over the 10 steps ending at each row\n")

    ok = [v for v in variants if len(runs[v]["losses"]) == a.steps]
    print_loss_tables({v: runs[v]["losses"] for v in ok}, REF, a.steps, a.every)
    print(f"\nStep time (means of steps {a.warmup + 1}-{a.steps}: the process's CPU time, robust to a shared core, and "
          f"wall time; the optimizer's wall mean over the first {a.warmup} steps apart) and state\n")
    print("| variant | params | step ms (CPU time) | step ms (wall) | optimizer ms (wall) | first steps' optimizer ms | "
          "optimizer state B/param | params B/param |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for v in variants:
        r = runs[v]
        if v not in ok:
            print(f"| {v} | {r.get('model_dtype', '')} | failed at step {r.get('error_at_step', 0)}: "
                  f"{r['error']} | | | | | |")
            continue
        w = min(a.warmup, a.steps - 1)
        mean = lambda xs: 1e3 * sum(xs) / len(xs)  # noqa: E731
        print(f"| {v} | {r['model_dtype'].replace('torch.', '')} | {mean(r['cpu_s'][w:]):.1f} | {mean(r['step_s'][w:]):.1f} | "
              f"{mean(r['opt_s'][w:]):.2f} | {mean(r['opt_s'][:w]) if w else 0:.1f} | "
              f"{r['state_bytes'] / r['n_params']:.3f} | {r['param_bytes'] / r['n_params']:.0f} |")
    n_params = next((runs[v]["n_params"] for v in ok), 0)
    print(f"\n({n_params} params; state counted from the optimizer's state tensors, each storage once)")
    if not a.no_moments:
        out, err = spawn("moments")
        print(f"\nMoment error after {a.msteps} steps on one float32 tensor of {a.mnumel} elements, the same "
              f"heavy-tailed gradients (g = randn * exp(2 z)) for every optimizer, against npukern's float32 "
              f"AdamW; u = m_hat / (sqrt(v_hat) + eps)\n")
        if out is None:
            print(f"failed: {err}")
        else:
            print("| z | optimizer | median \\|du\\|/\\|u\\| | p99 \\|du\\|/\\|u\\| | median dm/m | median dv/v | "
                  "v decoded 0 | sign flips of u | step ms | state B/element |")
            print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for r in out:
                if "error" in r:
                    print(f"| {r['kind']} | {r['opt']} | {r['error']} | | | | | | | |")
                    continue
                print(f"| {r['kind']} | {r['opt']} | {r['u_med']:.2e} | {r['u_p99']:.2e} | {r['m_med']:.2e} | "
                      f"{r['v_med']:.2e} | {100 * r['v_zero']:.3f}% | {100 * r['sign_flip']:.3f}% | "
                      f"{r['step_ms']:.1f} | {r['bytes_per_elem']:.3f} |")
    print(f"\n(total {time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
