"""A bf16 Hugging Face Llama training step, stock against npukern's
``hf.patch``, each in its own process (never both in one: allocator state,
caches and torch's thread pool would be shared).

One step is ``loss = model(x, labels=x).loss; loss.backward()`` with the
gradients dropped after it (``zero_grad(set_to_none=True)``), the model built
from a tiny config in the process (no download). The driver alternates stock
and patched processes ``--runs`` times and prints, per variant, the median
step time (each process: ``--warmup`` steps, then the median of ``--steps``)
and the peak resident memory above the model's (``ru_maxrss`` minus the RSS
after building the model and one warm-up step's inputs).

Run (one core, the issues' shared figure):
    taskset -c 0 python benches/hf_step.py --hidden 1024 --layers 2 --seq 512 --vocab 32000 --threads 1
All cores, hidden 2048:
    python benches/hf_step.py --hidden 2048 --layers 2 --seq 1024 --vocab 32000 --threads 0
Profile one variant (the top ops outside the matmuls):
    python benches/hf_step.py ... --child patched --profile
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


def child(args):
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate or int(args.hidden * 8 / 3 // 256 * 256),
                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                      num_key_value_heads=max(1, args.hidden // 256), vocab_size=args.vocab,
                      max_position_embeddings=max(2048, args.seq), tie_word_embeddings=args.tied,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.train()
    counts = None
    if args.child == "patched":
        import npukern_torch
        from npukern_torch import hf

        counts = hf.patch(model)
        if npukern_torch.detected_isa is None:
            raise SystemExit("npukern_torch has no ISA")
    x = torch.randint(0, args.vocab, (args.batch, args.seq))

    def step():
        loss = model(x, labels=x).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    base = rss_bytes()
    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"variant": args.child, "ms": statistics.median(times) * 1e3, "extra_mib": (peak - base) / 2**20,
           "threads": torch.get_num_threads(), "counts": counts, "torch": torch.__version__}
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
        if k in ("runs", "child") or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        passthrough += [flag] if v is True else [flag, str(v)]
    results = {"stock": [], "patched": []}
    for _ in range(args.runs):
        for variant in ("stock", "patched"):
            out = subprocess.run([sys.executable, __file__, *passthrough, "--child", variant], check=True,
                                 capture_output=True, text=True)
            results[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
    ms = {v: statistics.median(r["ms"] for r in rs) for v, rs in results.items()}
    mem = {v: statistics.median(r["extra_mib"] for r in rs) for v, rs in results.items()}
    first = results["patched"][0]
    print(f"hidden {args.hidden}, {args.layers} layers, seq {args.seq} x batch {args.batch}, vocab {args.vocab}, "
          f"bf16, sdpa, {first['threads']} thread(s), torch {first['torch']}; patched counts {first['counts']}")
    print(f"{'variant':8} {'step ms (median of ' + str(args.runs) + ' processes)':>38} {'all runs':>30} "
          f"{'peak extra MiB':>16}")
    for v in ("stock", "patched"):
        runs = ", ".join(f"{r['ms']:.0f}" for r in results[v])
        print(f"{v:8} {ms[v]:38.1f} {runs:>30} {mem[v]:16.0f}")
    print(f"patched / stock: time {ms['patched'] / ms['stock']:.3f}, peak extra memory "
          f"{mem['patched'] / mem['stock']:.3f}")


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
    p.add_argument("--child", choices=("stock", "patched"), help="run one variant in this process")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--profile-rows", type=int, default=25)
    args = p.parse_args()
    child(args) if args.child else driver(args)


if __name__ == "__main__":
    main()
