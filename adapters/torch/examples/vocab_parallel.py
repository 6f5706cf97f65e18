"""A Megatron-style trainer step with npukern_torch.parallel: the embedding
table split by vocabulary over the ranks, one global gradient norm, and a
check that the sharded run equals the single-process run bit for bit.

    torchrun --nproc-per-node 2 adapters/torch/examples/vocab_parallel.py
    python adapters/torch/examples/vocab_parallel.py [--world 2] [--steps 20]

(the second form starts the ranks itself with torch.multiprocessing). Any
torch.distributed backend works; this example uses gloo on CPU tensors."""

import argparse
import datetime
import os
import socket

import torch
import torch.distributed as dist

import npukern_torch
from npukern_torch import parallel

VOCAB, HIDDEN = 1000, 64


class LM(torch.nn.Module):
    def __init__(self, embedding):
        super().__init__()
        self.emb = embedding
        self.norm = npukern_torch.RMSNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens):
        return self.head(self.norm(self.emb(tokens)))


def step(model, opt, tokens, clip):
    opt.zero_grad()
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    norm = clip()
    opt.step()
    return loss.item(), norm.item()


def run(steps):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same full initialization on every rank
    reference = LM(npukern_torch.Embedding(VOCAB, HIDDEN, padding_idx=0))
    emb = parallel.VocabParallelEmbedding(VOCAB, HIDDEN, padding_idx=0)
    emb.load_full_weight_(reference.emb.weight.detach())
    model = LM(emb)
    model.load_state_dict({k: v for k, v in reference.state_dict().items() if k != "emb.weight"}, strict=False)
    replicated = [p for n, p in model.named_parameters() if n != "emb.weight"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    print(f"rank {rank}/{world}: rows [{emb.vocab_start}, {emb.vocab_end}) of {VOCAB}", flush=True)
    g = torch.Generator().manual_seed(1)  # the same batches on every rank (one tensor-parallel group)
    for i in range(steps):
        tokens = torch.randint(0, VOCAB, (8, 33), generator=g)
        loss, norm = step(model, opt, tokens,
                          lambda: parallel.clip_grad_norm_([emb.weight], 1.0, replicated_params=replicated))
        ref_loss, ref_norm = step(reference, ref_opt, tokens,
                                  lambda: npukern_torch.clip_grad_norm_(reference.parameters(), 1.0))
        if rank == 0:
            print(f"step {i:3d}  loss {loss:.6f} (one process {ref_loss:.6f})  norm {norm:.6f} "
                  f"(one process {ref_norm:.6f})", flush=True)
    full = emb.full_weight()  # gathered on every rank, e.g. for a checkpoint
    same = torch.equal(full, reference.emb.weight) and all(
        torch.equal(p, dict(reference.named_parameters())[n]) for n, p in model.named_parameters()
        if n != "emb.weight")
    if rank == 0:
        print(f"weights after {steps} steps bit-identical to one process: {same}", flush=True)
    return same


def worker(rank, world, port, steps):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                           timeout=datetime.timedelta(seconds=60))
    try:
        ok = run(steps)
        # Every rank done before any tears down: a rank still in gloo's last
        # exchange when its peer (or the store's host, rank 0) exits can abort.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


def main():
    ap = argparse.ArgumentParser(description="vocab-parallel embedding example")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        ok = run(args.steps)
        dist.barrier()
        dist.destroy_process_group()
        raise SystemExit(0 if ok else 1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(worker, args=(args.world, port, args.steps), nprocs=args.world)


if __name__ == "__main__":
    main()
