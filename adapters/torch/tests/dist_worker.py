"""One rank of the distributed tests (started by test_parallel.py with
RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT in the environment;
backend gloo). Each rank also runs the single-process model itself, so every
comparison is against the same arithmetic in the same process. Writes its
findings as JSON to the path in argv[2]; exits non-zero on any mismatch."""

import datetime
import hashlib
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


def _swap_rows(target, i, j):
    """``target`` with flat rows i and j swapped (made to differ first)."""
    t = target.reshape(-1).clone()
    if t[i] == t[j]:
        t[j] = (t[j] + 1) % 50
    t[i], t[j] = t[j].clone(), t[i].clone()
    return t.reshape(target.shape)


def _moved(target, by):
    """``target`` with its first row moved up by ``by`` classes."""
    t = target.reshape(-1).clone()
    t[0] = t[0] + by if t[0] >= 0 else 1 + by
    return t.reshape(target.shape)


def _wide_shard(shape, vocab, rank, world):
    """This rank's shard of random logits over a vocabulary of ``vocab``."""
    start, end = parallel.vocab_range(vocab, rank, world)
    return torch.randn(*shape, end - start, generator=torch.Generator().manual_seed(5))


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


def _ulps32(got, ref):
    """|got - ref| in float32 ulps of ref (0 where equal, NaNs included)."""
    g, r = got.double(), ref.double()
    _, e = torch.frexp(r.abs())
    unit = torch.ldexp(torch.ones_like(r), torch.clamp(e - 1, min=-126) - 23)
    same = (g == r) | (g.isnan() & r.isnan())
    return torch.where(same, torch.zeros_like(g), (g - r).abs() / unit)


def _ulp32(ref):
    """One float32 ulp at each value of `ref` (float64)."""
    _, e = torch.frexp(ref.double().abs())
    return torch.ldexp(torch.ones_like(ref, dtype=torch.float64), torch.clamp(e - 1, min=-126) - 23)


def _digest(t):
    """The bits of a tensor as a hex digest (equal on every rank or not)."""
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and _digest(a) == _digest(b)


def _ce_targets(shape, vocab, world, gen):
    """Random class ids with ignored rows and every shard's first and last
    class (the boundaries), the same on every rank."""
    t = torch.randint(0, vocab, shape, generator=gen).reshape(-1)
    edges = [c for r in range(world) for c in parallel.vocab_range(vocab, r, world)] + [0, vocab - 1]
    edges = [min(c, vocab - 1) for c in edges]
    t[: len(edges)] = torch.tensor(edges)
    t[len(edges) : len(edges) + 5] = -100
    return t.reshape(shape)


def vocab_parallel_ce(rank, world):
    """parallel.vocab_parallel_cross_entropy against F.cross_entropy of the
    full logits in this process (every rank builds the same full logits and
    slices its shard): the loss in float32 ulps, the shard's gradient against
    the same slice of the single-process one, the bits across runs and
    ranks, and the combined log-sum-exp against torch's (which explains the
    gradient's gaps: see test_parallel.py)."""
    from npukern_torch.parallel import cross_entropy as vce

    out = {}
    vocab, shape = 1001, (4, 12)
    gen = torch.Generator().manual_seed(21)
    full32 = torch.randn(*shape, vocab, generator=gen) * 2
    target = _ce_targets(shape, vocab, world, gen)
    start, end = parallel.vocab_range(vocab, rank, world)
    flat_t = target.reshape(-1)
    for dtype in (torch.float32, torch.bfloat16):
        full = full32.to(dtype)
        x = full.float().reshape(-1, vocab)
        # The combined max and log-sum-exp as the forward forms them, and torch's
        # own: log_softmax at the row's max is exactly -log(sum exp(x - max)).
        parts = torch.empty(4, x.shape[0])
        vce._partials(x[:, start:end], flat_t, start, -100, parts, 0.0)
        sizes = [e - s for s, e in (parallel.vocab_range(vocab, r, world) for r in range(world))]
        big, log_sum, _, _ = vce._combine(dist.group.WORLD, world, parts, sizes, 0.0)
        logp = torch.log_softmax(x, 1)
        ref_log_sum = -logp.gather(1, x.argmax(1, keepdim=True))[:, 0]
        lse_ulps = _ulps32(log_sum, ref_log_sum)
        name = str(dtype).split(".")[-1]
        out[f"{name}_lse_max_ulps"] = lse_ulps.max().item()
        out[f"{name}_lse_rows_equal"] = (lse_ulps == 0).float().mean().item()
        for eps in (0.0, 0.1):
            for red in ("none", "sum", "mean"):
                key = f"{name}_{red}_{eps}"
                shard = full[..., start:end].clone().requires_grad_()
                loss = parallel.vocab_parallel_cross_entropy(shard, target, reduction=red, label_smoothing=eps)
                again = parallel.vocab_parallel_cross_entropy(shard.detach(), target, reduction=red,
                                                              label_smoothing=eps)
                ref_x = full.float().clone().requires_grad_()
                ref = torch.nn.functional.cross_entropy(ref_x.reshape(-1, vocab), flat_t, reduction=red,
                                                        label_smoothing=eps)
                ref = ref.reshape(shape) if red == "none" else ref
                up = torch.randn(loss.shape, generator=torch.Generator().manual_seed(5)) if red == "none" \
                    else torch.tensor(1.3)
                (loss * up).sum().backward()
                (ref * up).sum().backward()
                g = shard.grad.reshape(-1, end - start).double()
                r = ref_x.grad.reshape(-1, vocab)[:, start:end].double()
                # The per-element scale of the log-softmax backward's terms, in float64:
                # every = dloss/dlogp at each class, total = its sum over the classes.
                at, every, total = vce._row_coefs(up.reshape(-1) if red == "none" else up,
                                                  flat_t != -100, red, eps, vocab)
                # The log-softmax backward's terms per element, g_j - exp(logp_j) * sum(g):
                # their magnitude is the scale its rounding is measured in.
                soft = logp[:, start:end].double().exp() * total.double()[:, None]
                terms = soft.abs() + every.double().abs()[:, None]
                local = flat_t - start
                hit = ((local >= 0) & (local < end - start)).nonzero()[:, 0]
                terms[hit, local[hit]] += (at - every).double().abs()[hit]  # the target's own term
                # A log-sum-exp d away from torch's moves logp (rounded) by at most
                # d + 1 ulp of logp, and exp(logp) by exp(logp) times that.
                dlse = (log_sum - ref_log_sum).double().abs()[:, None]
                dlogp = torch.where(dlse > 0, dlse + _ulp32(logp[:, start:end]), torch.zeros_like(dlse))
                moved = 1.01 * soft.abs() * dlogp
                # Exact float64 gradient, to compare the two float32 ones' accuracy.
                x64 = full.double().requires_grad_()
                ref64 = torch.nn.functional.cross_entropy(x64.reshape(-1, vocab), flat_t, reduction=red,
                                                          label_smoothing=eps)
                (ref64.reshape(up.shape) * up.double()).sum().backward()
                g64 = x64.grad.reshape(-1, vocab)[:, start:end]
                units = _ulp32(torch.maximum(terms, r.abs()))  # a result rounded up into the next binade
                # With label smoothing torch's sum(g) adds C terms in its vectorized order (8 or
                # 16 lanes: at most C/8 + 8 roundings of it), ours is at + C * every.
                summed = logp[:, start:end].double().exp() * (vocab / 8 + 8) * _ulp32(total)[:, None] if eps else 0.0
                half = (1.01 * 2.0 ** -8 * r.abs()) if dtype == torch.bfloat16 else 0.0  # rounded to bf16
                out[key] = {
                    "loss_ulps": _ulps32(loss.detach(), ref.detach()).max().item(),
                    "dtype": str(loss.dtype),
                    "repeat_bits_equal": bits_equal(loss.detach(), again),
                    "loss_digest": _digest(loss),
                    "lse_digest": _digest(log_sum),
                    # |ours - torch's| / (3 ulps of the terms + what the lse difference moves):
                    # torch's log-softmax backward takes exp with its own vectorized exp, whose
                    # last bit can differ from torch.exp's, then times sum(g) and a subtraction.
                    "grad_bound_ratio": ((g - r).abs() / (3 * units + moved + summed + half)).max().item(),
                    # on rows whose log-sum-exp is torch's bits: |ours - torch's| in ulps of the terms
                    "grad_ulps_equal_lse_rows": torch.cat([((g - r).abs() / units)[dlse[:, 0] == 0].reshape(-1),
                                                            torch.zeros(1, dtype=torch.float64)]).max().item(),
                    # accuracy against float64, in ulps of the terms: ours and torch's
                    "grad_ulps_vs_f64": ((g - g64).abs() / units).max().item(),
                    "torch_grad_ulps_vs_f64": ((r - g64).abs() / units).max().item(),
                    "ignored_rows_zero": bool((shard.grad.reshape(-1, end - start)[flat_t == -100] == 0).all()),
                }
    # Every row ignored: NaN for mean, 0 for sum, as torch.
    ignored = torch.full(shape, -100)
    shard = full32[..., start:end]
    out["all_ignored_mean_nan"] = math.isnan(parallel.vocab_parallel_cross_entropy(shard, ignored).item())
    out["all_ignored_sum_zero"] = parallel.vocab_parallel_cross_entropy(shard, ignored, reduction="sum").item() == 0
    # float64 logits: computed in float64, as torch's.
    s64 = full32.double()[..., start:end].clone().requires_grad_()
    f64 = full32.double().requires_grad_()
    loss64 = parallel.vocab_parallel_cross_entropy(s64, target, label_smoothing=0.1)
    ref64 = torch.nn.functional.cross_entropy(f64.reshape(-1, vocab), flat_t, label_smoothing=0.1)
    loss64.backward()
    ref64.backward()
    out["f64_loss_rel"] = abs(loss64.item() - ref64.item()) / ref64.item()
    out["f64_dtypes"] = [str(loss64.dtype), str(s64.grad.dtype)]
    out["f64_grad_diff"] = (s64.grad - f64.grad[..., start:end]).abs().max().item()
    # int32 targets, another ignore_index.
    other = target.masked_fill(target == -100, 7).int()
    a = parallel.vocab_parallel_cross_entropy(shard, other, ignore_index=7)
    b = torch.nn.functional.cross_entropy(full32.reshape(-1, vocab), other.reshape(-1).long(), ignore_index=7)
    out["int32_ignore7_ulps"] = _ulps32(a, b).item()
    before = parallel.vocab_parallel_cross_entropy(shard, target)
    out["errors"] = {
        "too_big": _raised(lambda: parallel.vocab_parallel_cross_entropy(
            shard, target.reshape(-1).index_fill(0, torch.tensor([30]), vocab).reshape(shape))),
        "negative": _raised(lambda: parallel.vocab_parallel_cross_entropy(
            shard, target.reshape(-1).index_fill(0, torch.tensor([31]), -5).reshape(shape))),
        # One rank only: a target of the wrong shape; a different (valid) target.
        "shape_one_rank": _raised(lambda: parallel.vocab_parallel_cross_entropy(
            shard, target[:3] if rank == world - 1 else target)),
        "different_target": _raised(lambda: parallel.vocab_parallel_cross_entropy(
            shard, target.reshape(-1).index_fill(0, torch.tensor([40]), 3).reshape(shape) if rank == 0 else target)),
        # Targets the checksum weighed alike (ids by position mod 251, values
        # mod 65 521): two rows swapped on rank 0, one 251 positions apart
        # from another, and a target moved by 65 521 (issue 47).
        "swapped_rows": _raised(lambda: parallel.vocab_parallel_cross_entropy(
            shard, _swap_rows(target, 3, 5) if rank == 0 else target)),
        "moved_by_65521": _raised(lambda: parallel.vocab_parallel_cross_entropy(
            _wide_shard(shape, 70000, rank, world), _moved(target, 65521) if rank == 0 else target)),
        # A shard not in vocab_range's layout (two classes short on rank 0).
        "layout": _raised(lambda: parallel.vocab_parallel_cross_entropy(
            shard[..., 2:] if rank == 0 else shard, target)),
    }
    # After the failures the collectives still pair: the same bits as before them.
    out["after_errors_ok"] = bits_equal(parallel.vocab_parallel_cross_entropy(shard, target), before)
    return out


def vocab_parallel_linear_ce(rank, world):
    """parallel.vocab_parallel_linear_cross_entropy against float64
    F.cross_entropy(input @ W.T) in this process: the loss, this rank's rows
    of the weight gradient and the input gradient, f32 and bf16."""
    out = {}
    vocab, hidden, shape = 1001, 32, (4, 12)
    gen = torch.Generator().manual_seed(33)
    inp32 = torch.randn(*shape, hidden, generator=gen)
    w32 = torch.randn(vocab, hidden, generator=gen) * 0.3
    target = _ce_targets(shape, vocab, world, gen)
    flat_t = target.reshape(-1)
    start, end = parallel.vocab_range(vocab, rank, world)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        for eps in (0.0, 0.1):
            for red in ("sum", "mean"):
                inp, w = inp32.to(dtype), w32.to(dtype)
                runs = []
                for _ in range(2):
                    x = inp.clone().requires_grad_()
                    ws = w[start:end].clone().requires_grad_()
                    # 4 KiB: 1-4 rows of logits per chunk, many chunks; the d_input gather in slices too.
                    loss = parallel.vocab_parallel_linear_cross_entropy(x, ws, target, reduction=red,
                                                                        label_smoothing=eps, chunk_bytes=4096)
                    (loss * 1.7).backward()
                    runs.append((loss.detach(), ws.grad, x.grad))
                x64 = inp.double().requires_grad_()
                w64 = w.double().requires_grad_()
                ref = torch.nn.functional.cross_entropy((x64 @ w64.t()).reshape(-1, vocab), flat_t, reduction=red,
                                                        label_smoothing=eps)
                (ref * 1.7).backward()
                loss, dw, dx = runs[0]
                ref_dw, ref_dx = w64.grad[start:end], x64.grad
                single = torch.nn.functional.cross_entropy((inp.float() @ w.float().t()).reshape(-1, vocab), flat_t,
                                                           reduction=red, label_smoothing=eps)
                out[f"{name}_{red}_{eps}"] = {
                    "loss_dtype": str(loss.dtype),
                    "loss_rel": abs(loss.item() - ref.item()) / abs(ref.item()),
                    "loss_ulps_vs_single_f32": _ulps32(loss, single).item(),
                    "dw_dtype": str(dw.dtype),
                    "dw_rel": ((dw.double() - ref_dw).abs().max() / ref_dw.abs().max()).item(),
                    # elementwise, in units of the gradient's own dtype at the reference
                    "dw_elem_rel": ((dw.double() - ref_dw).abs() / ref_dw.abs().clamp_min(1e-3 * ref_dw.abs().max()))
                    .max().item(),
                    "dx_rel": ((dx.double() - ref_dx).abs().max() / ref_dx.abs().max()).item(),
                    "dx_digest": _digest(dx),
                    "loss_digest": _digest(loss),
                    "repeat_bits_equal": all(_same_bits(a, b) for a, b in zip(runs[0], runs[1])),
                }
    x, ws = inp32.clone().requires_grad_(), w32[start:end].clone().requires_grad_()
    bad = flat_t.clone()
    bad[17] = vocab + 3
    out["errors"] = {
        "too_big": _raised(lambda: parallel.vocab_parallel_linear_cross_entropy(x, ws, bad.reshape(shape))),
        "none": _raised(lambda: parallel.vocab_parallel_linear_cross_entropy(x, ws, target, reduction="none")),
    }
    # Only the weight needs a gradient on one rank, the input on the others: the
    # d_input gather still pairs (no hang) and the loss is unchanged.
    x2 = inp32.clone().requires_grad_(rank != 0)
    loss2 = parallel.vocab_parallel_linear_cross_entropy(x2, ws, target, chunk_bytes=4096)
    out["mixed_needs_ok"] = bits_equal(loss2.detach(), parallel.vocab_parallel_linear_cross_entropy(
        inp32, w32[start:end], target, chunk_bytes=4096))
    # The default chunk budget (one chunk).
    out["default_chunk_loss_rel"] = abs(parallel.vocab_parallel_linear_cross_entropy(inp32, w32[start:end], target)
                                        .item() - loss2.item()) / loss2.item()
    return out


def main():
    mode, path = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)  # the same GEMM summation order in every process
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "ce":  # the vocab-parallel cross-entropy only
        result = {"ce": vocab_parallel_ce(rank, world), "linear": vocab_parallel_linear_ce(rank, world)}
    else:
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
