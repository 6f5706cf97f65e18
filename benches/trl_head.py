"""Forward + backward of a Llama under TRL's fused LM head
(``trl.trainer.utils.add_fused_lm_head``, what TRL 1.x's trainers put on
the model), stock and ``hf.patch``ed, beside the same model without it.

Variants (each in its own process, alternated, ``--runs`` each):
``stock`` and ``patched`` (``model(x, labels=x)``: stock's loss, npukern's
fused loss), ``stock_trl`` and ``patched_trl`` (TRL's head,
``fused_lm_head=True``: TRL's own function, npukern's for the patched
model). ``--autocast``: float32 params under ``torch.autocast("cpu",
torch.bfloat16)`` (SFTTrainer's default ``bf16=True``), else a bf16 model.
``--outputs``: what the head computes beside the log-probabilities, as
each trainer asks (``sft``: entropy, top-1; ``dpo``: also the mean logit;
``kto``: entropy, mean logit; ``grpo``, ``rloo``: entropy). ``--temperature``: GRPO's and RLOO's
sampling temperature in the head (TRL's logits over it, float32).

    taskset -c 1 python benches/trl_head.py --threads 1 --runs 3 [--autocast] [--outputs dpo] [--temperature 0.7]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

# The optional outputs each TRL 1.16 trainer asks its fused head for.
OUTPUTS = {"sft": ("entropy", "is_top1"), "dpo": ("entropy", "mean_logits", "is_top1"),
           "kto": ("entropy", "mean_logits"), "grpo": ("entropy",), "rloo": ("entropy",)}


def child(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
                      vocab_size=args.vocab, max_position_embeddings=max(2048, args.seq), attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(torch.float32 if args.autocast else torch.bfloat16).train()
    if args.child.startswith("patched"):
        from npukern_torch import hf

        hf.patch(model)
    trl = args.child.endswith("_trl")
    if trl:
        add_fused_lm_head(model, temperature=args.temperature, outputs=("log_probs",) + OUTPUTS[args.outputs])
    x = torch.randint(0, args.vocab, (1, args.seq))
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.process_time()
        with torch.autocast("cpu", torch.bfloat16, enabled=args.autocast):
            out = model(x, labels=x, fused_lm_head=True) if trl else model(x, labels=x)
        out.loss.backward()
        if i >= args.warmup:
            times.append(time.process_time() - t0)
        model.zero_grad(set_to_none=True)
    print(json.dumps({"variant": args.child, "ms": statistics.median(times) * 1e3, "loss": out.loss.item()}))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--autocast", action="store_true")
    p.add_argument("--outputs", choices=tuple(OUTPUTS), default="sft")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--child", choices=("stock", "patched", "stock_trl", "patched_trl"))
    args = p.parse_args()
    if args.child:
        return child(args)
    variants = ("stock", "patched", "stock_trl", "patched_trl")
    ms = {v: [] for v in variants}
    for _ in range(args.runs):
        for v in variants:
            cmd = [sys.executable, __file__, "--child", v] + [a for a in sys.argv[1:] if a != "--child"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            ms[v].append(json.loads(out)["ms"])
    print(f"{args.outputs}'s outputs, temperature {args.temperature}, {'autocast, float32 params' if args.autocast else 'bf16 model'}, hidden {args.hidden} x {args.layers} "
          f"layers, vocab {args.vocab}, {args.seq} tokens, {args.threads} thread(s): forward + backward, ms")
    for v in variants:
        print(f"{v:12s} median {statistics.median(ms[v]):8.1f}   runs {', '.join(f'{t:.0f}' for t in ms[v])}")


if __name__ == "__main__":
    main()
