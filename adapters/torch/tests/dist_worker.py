"""One rank of the distributed tests (started by test_parallel.py with
RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT in the environment;
backend gloo). Each rank also runs the single-process model itself, so every
comparison is against the same arithmetic in the same process. Writes its
findings as JSON to the path in argv[2]; exits non-zero on any mismatch."""

import datetime
import json
import math
import os
import sys

import torch
import torch.distributed as dist

import npukern_torch
from npukern_torch import parallel
from tiny_llama import BATCH, HIDDEN, SEQ, VOCAB, batches, initial_state, loss_fn, npukern_model

ops = torch.ops.npukern


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def train(max_norm, steps, rank, world):
    """The tiny model with a vocab-parallel embedding against the same model
    in one process; returns what matched bit for bit and the largest gaps."""
    state = initial_state()
    single = npukern_model()
    single.load_state_dict(state)
    emb = parallel.VocabParallelEmbedding(VOCAB, HIDDEN, padding_idx=0).load_full_weight_(state["emb.weight"])
    sharded = npukern_model(embedding=emb)
    sharded.load_state_dict({k: v for k, v in state.items() if k != "emb.weight"}, strict=False)
    opt_1 = torch.optim.Adam(single.parameters(), lr=1e-2)
    opt_n = torch.optim.Adam(sharded.parameters(), lr=1e-2)
    replicated = [p for n, p in sharded.named_parameters() if n != "emb.weight"]
    start, end = emb.vocab_start, emb.vocab_end
    out = {"grads_bit_identical": True, "losses_bit_identical": True, "max_norm_rel": 0.0, "clip_active_steps": 0}
    for tokens, targets in batches(steps):
        opt_1.zero_grad()
        opt_n.zero_grad()
        loss_1 = loss_fn(single, tokens, targets)
        loss_n = loss_fn(sharded, tokens, targets)
        loss_1.backward()
        loss_n.backward()
        out["losses_bit_identical"] &= bits_equal(loss_1.detach(), loss_n.detach())
        # Before clipping: the shard's rows and every replicated gradient.
        g1 = dict(single.named_parameters())
        same = bits_equal(emb.weight.grad, g1["emb.weight"].grad[start:end])
        for n, p in sharded.named_parameters():
            if n != "emb.weight":
                same &= bits_equal(p.grad, g1[n].grad)
        # npukern_torch.clip_grad_norm_'s op, for its float64 result.
        norm_1 = ops.clip_grad_norm_([p.grad for p in single.parameters()], max_norm)
        norm_n = parallel.clip_grad_norm_([emb.weight], max_norm, replicated_params=replicated)
        out["clip_active_steps"] += int(norm_1.item() > max_norm)
        # The exact f64 norms: the op's result and the all-reduced one.
        rel = abs(norm_n.item() - norm_1.item()) / norm_1.item()
        out["max_norm_rel"] = max(out["max_norm_rel"], rel)
        # After clipping (a no-op when inactive): still bit-identical?
        same &= bits_equal(emb.weight.grad, g1["emb.weight"].grad[start:end])
        for n, p in sharded.named_parameters():
            if n != "emb.weight":
                same &= bits_equal(p.grad, g1[n].grad)
        out["grads_bit_identical"] &= bool(same)
        opt_1.step()
        opt_n.step()
    full = emb.full_weight()
    w1 = dict(single.named_parameters())
    diffs = [(full - w1["emb.weight"]).abs().max().item()]
    diffs += [(p - w1[n]).abs().max().item() for n, p in sharded.named_parameters() if n != "emb.weight"]
    out["max_weight_diff"] = max(diffs)
    out["weights_bit_identical"] = bits_equal(full, w1["emb.weight"].detach()) and all(
        bits_equal(p.detach(), w1[n].detach()) for n, p in sharded.named_parameters() if n != "emb.weight"
    )
    return out


def shard_semantics(rank, world):
    """padding_idx, scale_grad_by_freq, duplicates: the shard gradient is the
    full kernel's rows bit for bit; bad ids raise IndexError on every rank;
    NaN on one rank reaches every rank's norm."""
    out = {}
    g = torch.Generator().manual_seed(3)
    v, h = 23, 8
    indices = torch.randint(0, v, (5, 40), generator=g)
    indices[0, :10] = 4  # many duplicates of one id
    up = torch.randn(5, 40, h, generator=g)
    ok = True
    for padding_idx in (None, 4, -3):
        for scale in (False, True):
            emb = parallel.VocabParallelEmbedding(v, h, padding_idx=padding_idx, scale_grad_by_freq=scale)
            full = torch.randn(v, h, generator=torch.Generator().manual_seed(11))
            emb.load_full_weight_(full)
            ok &= bits_equal(emb.full_weight(), full)
            ref = npukern_torch.Embedding(v, h, padding_idx=padding_idx, scale_grad_by_freq=scale)
            with torch.no_grad():
                ref.weight.copy_(full)
            y, y1 = emb(indices), ref(indices)
            ok &= bits_equal(y.detach(), y1.detach())
            (y * up).sum().backward()
            (y1 * up).sum().backward()
            ok &= bits_equal(emb.weight.grad, ref.weight.grad[emb.vocab_start : emb.vocab_end])
            # The op directly, and against aten's own unsharded backward in float64.
            pad = -1 if ref.padding_idx is None else ref.padding_idx
            shard = ops.embedding_dense_backward_shard(up, indices, emb.vocab_end - emb.vocab_start,
                                                       emb.vocab_start, pad, scale)
            ok &= bits_equal(shard, emb.weight.grad)
            aten = torch.ops.aten.embedding_dense_backward(up.double(), indices, v, pad, scale)
            ok &= bool((shard.double() - aten[emb.vocab_start : emb.vocab_end]).abs().max() <= 1e-5)
    out["shard_grads_bit_identical"] = bool(ok)
    emb = parallel.VocabParallelEmbedding(v, h)
    for bad in (v, -1):
        try:
            emb(torch.tensor([[1, 2], [bad, 3]]))
            out[f"index_error_{bad}"] = ""
        except IndexError as e:
            out[f"index_error_{bad}"] = str(e)
    # NaN only on the last rank: every rank's norm is NaN, every gradient NaN.
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    if rank == world - 1:
        p.grad[2] = float("nan")
    total = parallel.clip_grad_norm_([p], 1.0)
    out["nan_seen"] = math.isnan(total.item()) and bool(p.grad.isnan().all())
    p.grad = torch.ones(4) * (float("inf") if rank == 0 else 1.0)
    before = p.grad.clone()
    try:
        parallel.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
        out["nonfinite_raised"] = False
    except RuntimeError:
        out["nonfinite_raised"] = bool(torch.equal(p.grad, before))
    # Replicated parameters are counted once: 4 ranks' worth of ones would be 2x.
    q = torch.nn.Parameter(torch.zeros(9))
    q.grad = torch.full((9,), 2.0)
    shard = torch.nn.Parameter(torch.zeros(1))
    shard.grad = torch.full((1,), float(rank + 1))
    total = parallel.clip_grad_norm_([shard], 1e9, replicated_params=[q]).item()
    expect = math.sqrt(36.0 + sum((r + 1) ** 2 for r in range(world)))
    out["replicated_once"] = abs(total - expect) <= 1e-6 * expect
    return out


def _raised(call):
    """The exception type name `call` raised ("" if none) and its message."""
    try:
        call()
        return "", ""
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)


def rank_local_failures(rank, world):
    """Review defect 6: a failure on one rank only (a bad id, different
    indices, a bad max_norm, an unsupported gradient) raises the same type on
    every rank together -- no rank blocks -- and the next, correct step still
    pairs its collectives and gives the single-process result. Defect 4:
    float64 works in both layers."""
    out = {}
    v, h = 23, 8
    full = torch.randn(v, h, generator=torch.Generator().manual_seed(5))
    emb = parallel.VocabParallelEmbedding(v, h).load_full_weight_(full)
    good = torch.tensor([[1, 2], [22, 3]])
    bad = good.clone()
    if rank == world - 1:
        bad[1, 0] = v  # out of range on the last rank only
    out["bad_id_one_rank"] = _raised(lambda: emb(bad))
    other = good.clone()
    if rank == 0:
        other[0, 0] = 7  # valid, but not what the other ranks pass
    out["different_indices"] = _raised(lambda: emb(other))
    out["next_step_ok"] = bits_equal(emb(good).detach(), full[good])
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3.0)
    before = p.grad.clone()
    out["bad_max_norm_one_rank"] = _raised(
        lambda: parallel.clip_grad_norm_([p], float("nan") if rank == 0 else 1.0))
    out["untouched_after_failure"] = bool(torch.equal(p.grad, before))
    q = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    q.grad = torch.ones(2, dtype=torch.complex64)
    out["complex_grad_one_rank"] = _raised(
        lambda: parallel.clip_grad_norm_([p, q] if rank == world - 1 else [p], 1.0))
    total = parallel.clip_grad_norm_([p], 1e9).item()
    out["next_clip_ok"] = abs(total - 6.0 * math.sqrt(world)) <= 1e-12 * total
    # float64: the layer and the clip take it, like the single-process ones.
    g = torch.Generator().manual_seed(9)
    idx = torch.randint(0, v, (6, 5), generator=g)
    up = torch.randn(6, 5, h, generator=g, dtype=torch.float64)
    for padding_idx, scale in ((None, False), (4, True)):
        e64 = parallel.VocabParallelEmbedding(v, h, padding_idx=padding_idx, scale_grad_by_freq=scale,
                                              dtype=torch.float64).load_full_weight_(full.double())
        ref = torch.nn.Embedding(v, h, padding_idx=padding_idx, scale_grad_by_freq=scale, dtype=torch.float64)
        with torch.no_grad():
            ref.weight.copy_(full.double())
        y, y1 = e64(idx), ref(idx)
        (y * up).sum().backward()
        (y1 * up).sum().backward()
        rows = ref.weight.grad[e64.vocab_start : e64.vocab_end]
        out[f"f64_lookup_equal_{padding_idx}"] = bool(torch.equal(y.detach(), y1.detach()))
        out[f"f64_grad_diff_{padding_idx}"] = (e64.weight.grad - rows).abs().max().item() if rows.numel() else 0.0
        total64 = parallel.clip_grad_norm_([e64.weight], 1e9).item()
        exact = ref.weight.grad.norm().item()
        out[f"f64_clip_rel_{padding_idx}"] = abs(total64 - exact) / exact
    return out


def main():
    mode, path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)  # the same GEMM summation order in every process
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    result = shard_semantics(rank, world)
    result["failures"] = rank_local_failures(rank, world)
    if mode == "all":
        result.update(inactive=train(1e9, 50, rank, world), active=train(0.5, 50, rank, world))
    result["rank"], result["world"] = rank, world
    dist.barrier()
    dist.destroy_process_group()
    with open(path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    assert BATCH and SEQ  # the task's sizes come from tiny_llama
    main()
    os._exit(0)
