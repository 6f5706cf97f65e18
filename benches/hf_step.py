"""A bf16 Hugging Face Llama training step, stock against npukern's
``hf.patch``, each in its own process (never both in one: allocator state,
caches and torch's thread pool would be shared).

One step is ``loss = model(x, labels=x).loss; loss.backward()`` with the
gradients dropped after it (``zero_grad(set_to_none=True)``), the model built
from a tiny config in the process (no download). The driver alternates stock
and patched processes ``--runs`` times and prints, per variant, the median
step time (each process: ``--warmup`` steps, then the median of ``--steps``)
the peak resident memory above the model's (``ru_maxrss`` minus the RSS
after building the model and one warm-up step's inputs), and the peak above
the interpreter before the model was built (``peak total``: the model, the
optimizer's state and the step; what to compare when the variants hold the
model in different dtypes, as ``--recipe trainer`` does).

Run (one core, the issues' shared figure):
    taskset -c 0 python benches/hf_step.py --hidden 1024 --layers 2 --seq 512 --vocab 32000 --threads 1
All cores, hidden 2048:
    python benches/hf_step.py --hidden 2048 --layers 2 --seq 1024 --vocab 32000 --threads 0
Profile one variant (the top ops outside the matmuls):
    python benches/hf_step.py ... --child patched --profile

The whole step users run (``--recipe trainer``): stock is Hugging Face
Trainer's CPU ``bf16=True`` recipe -- float32 params, forward and backward
under ``torch.autocast("cpu", torch.bfloat16)``, ``clip_grad_norm_(1.0)``,
``torch.optim.AdamW(fused=True).step()``; ``patched`` holds the model in
bf16, patched, and steps ``npukern_torch.optim.AdamW(master_weights=True,
max_grad_norm=1.0)`` (no autocast, no separate clip); ``patched_autocast``
is the patched model in Trainer's recipe with npukern's optimizer;
``stock_f32`` is stock in float32 without autocast (clip, fused AdamW): what
a user on a CPU whose bf16 matmul is slow also tries; ``patched_f32`` is
that float32 model patched, stepped by ``npukern_torch.optim.AdamW(
max_grad_norm=1.0)`` (no masters: the params are float32). ``--linear`` is
``hf.patch``'s (``auto``: the route's rule). Per
variant the step and its parts (forward + backward, clip, optimizer step):
    taskset -c 0 python benches/hf_step.py --recipe trainer --threads 1

The allocator moves the ratio: stock's step frees and re-allocates buffers
above glibc's largest heap size (32 MiB: float32 grads of the embedding and
LM head, the logits, autocast's weight copies) every step, and each comes
back from the kernel as fresh zeroed pages. ``--malloc retain`` runs every
child with glibc keeping freed memory (``MALLOC_MMAP_MAX_=0``,
``MALLOC_TRIM_THRESHOLD_`` unbounded), which is what jemalloc or tcmalloc
(preloaded by IPEX's and torch's CPU launchers) also do; ``--malloc
PATH`` preloads the allocator at PATH (``LD_PRELOAD``).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


CLOCK = time.perf_counter


def child(args):
    global CLOCK
    if args.clock == "process":
        CLOCK = time.process_time
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    before_model = rss_bytes()
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate or int(args.hidden * 8 / 3 // 256 * 256),
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
                      max_position_embeddings=max(2048, args.seq), tie_word_embeddings=args.tied,
                      attn_implementation="sdpa")
    trainer = args.recipe == "trainer"
    f32_params = trainer and args.child in ("stock", "patched_autocast", "stock_f32", "patched_f32")
    model = LlamaForCausalLM(cfg).to(torch.float32 if f32_params else torch.bfloat16)
    model.train()
    counts = None
    if args.child in ("patched", "patched_autocast", "patched_f32"):
        import npukern_torch
        from npukern_torch import hf

        counts = hf.patch(model, linear={"auto": True, "torch": False, "npukern": "npukern"}[args.linear])
        if npukern_torch.detected_isa is None:
            raise SystemExit("npukern_torch has no ISA")
    x = torch.randint(0, args.vocab, (args.batch, args.seq))

    parts = {"fwd_bwd": [], "clip": [], "opt": []}
    opt = None
    if trainer and args.child in ("stock", "stock_f32"):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    elif trainer:
        from npukern_torch.optim import AdamW

        opt = AdamW(model.parameters(), lr=1e-5, master_weights=args.child == "patched", max_grad_norm=1.0)
    autocast = trainer and args.child not in ("patched", "stock_f32", "patched_f32")

    def step():
        t0 = CLOCK()
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = model(x, labels=x).loss
        loss.backward()
        t1 = CLOCK()
        if args.child in ("stock", "stock_f32") and trainer:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        t2 = CLOCK()
        if opt is not None:
            opt.step()
        t3 = CLOCK()
        model.zero_grad(set_to_none=True)
        for k, t in (("fwd_bwd", t1 - t0), ("clip", t2 - t1), ("opt", t3 - t2)):
            parts[k].append(t)
        return loss

    base = rss_bytes()
    for _ in range(args.warmup):
        step()
    times = []
    for k in parts:
        parts[k].clear()
    for _ in range(args.steps):
        t0 = CLOCK()
        step()
        times.append(CLOCK() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"variant": args.child, "ms": statistics.median(times) * 1e3, "extra_mib": (peak - base) / 2**20,
           "total_mib": (peak - before_model) / 2**20,
           "threads": torch.get_num_threads(), "counts": counts, "torch": torch.__version__,
           "parts": {k: statistics.median(v) * 1e3 for k, v in parts.items()}}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows)
        print(table, file=sys.stderr)
    print(json.dumps(out))


def driver(args):
    passthrough = []
    for k, v in vars(args).items():
        if k in ("runs", "child", "malloc") or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        passthrough += [flag] if v is True else [flag, str(v)]
    variants = ("stock", "patched", "patched_autocast", "stock_f32", "patched_f32") if args.recipe == "trainer" \
        else ("stock", "patched")
    results = {v: [] for v in variants}
    env = dict(os.environ)
    if args.malloc == "retain":
        env.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 62))
    elif args.malloc != "glibc":
        env["LD_PRELOAD"] = args.malloc
    for _ in range(args.runs):
        for variant in variants:
            out = subprocess.run([sys.executable, __file__, *passthrough, "--child", variant], check=True,
                                 capture_output=True, text=True, env=env)
            results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    ms = {v: statistics.median(r["ms"] for r in rs) for v, rs in results.items()}
    mem = {v: statistics.median(r["extra_mib"] for r in rs) for v, rs in results.items()}
    tot = {v: statistics.median(r["total_mib"] for r in rs) for v, rs in results.items()}
    first = results["patched"][0]
    print(f"hidden {args.hidden}, {args.layers} layers, seq {args.seq} x batch {args.batch}, vocab {args.vocab}, "
          f"bf16, sdpa, {first['threads']} thread(s), torch {first['torch']}; patched counts {first['counts']}")
    print(f"recipe {args.recipe}, malloc {args.malloc}")
    print(f"{'variant':16} {'step ms (median of ' + str(args.runs) + ' processes)':>38} {'all runs':>24} "
          f"{'fwd+bwd':>8} {'clip':>6} {'opt':>6} {'peak extra MiB':>16} {'peak total MiB':>15}")
    for v in variants:
        runs = ", ".join(f"{r['ms']:.0f}" for r in results[v])
        pm = {k: statistics.median(r["parts"][k] for r in results[v]) for k in ("fwd_bwd", "clip", "opt")}
        print(f"{v:16} {ms[v]:38.1f} {runs:>24} {pm['fwd_bwd']:8.1f} {pm['clip']:6.1f} {pm['opt']:6.1f} "
              f"{mem[v]:16.0f} {tot[v]:15.0f}")
    for v in variants[1:]:
        print(f"{v} / stock: time {ms[v] / ms['stock']:.3f}, peak extra memory {mem[v] / mem['stock']:.3f}, "
              f"peak total memory {tot[v] / tot['stock']:.3f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=0, help="default: 8/3 hidden rounded down to 256")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tied", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default, all cores)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--runs", type=int, default=3, help="processes per variant, alternating")
    p.add_argument("--recipe", choices=("fwdbwd", "trainer"), default="fwdbwd",
                   help="fwdbwd: forward + backward of a bf16 model; trainer: the whole step (see above)")
    p.add_argument("--child", choices=("stock", "patched", "patched_autocast", "stock_f32", "patched_f32"),
                   help="run one variant in this process")
    p.add_argument("--linear", choices=("auto", "torch", "npukern"), default="auto",
                   help="hf.patch's linear: the route's rule (auto), torch's matmuls, or npukern's always")
    p.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="process: the process's CPU time (with --threads 1 the step's own time even on a machine "
                        "busy with other work; page faults count, waiting does not)")
    p.add_argument("--malloc", default="glibc",
                   help="the children's allocator: glibc (its defaults), retain (glibc keeping freed memory), "
                        "or the path of an allocator to preload (libjemalloc.so.2, libtcmalloc.so.4)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-rows", type=int, default=25)
    args = p.parse_args()
    child(args) if args.child else driver(args)


if __name__ == "__main__":
    main()
