"""One rank of test_optim_dist.py (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
in the environment; gloo). Mode ``ddp``: a bf16 MLP under
DistributedDataParallel stepped by npukern's AdamW (master weights, the clip
inside the step) against the same model in this process fed the ranks'
averaged gradients (DDP divides each by the world size and all-reduces:
g0 / 2 + g1 / 2, exact) -- bitwise equal after 10 steps. Mode ``fsdp2``:
the float32 MLP under ``fully_shard`` (DTensor shards) against the
unsharded model in this process on the full batch -- within the bound the
test states; the clip's norm is all-reduced across the shards. Modes
``fsdp2_int8_*``: 8-bit moments under ``fully_shard``, bit for bit (see
``fsdp2_int8``). Writes JSON to argv[2]."""

import copy
import datetime
import json
import sys

import torch
import torch.distributed as dist

import npukern_torch  # noqa: F401
from npukern_torch.optim import AdamW

STEPS = 10


def mlp(dtype, hidden=64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 32),
                               torch.nn.GELU(), torch.nn.Linear(32, 8)).to(dtype)


def batch(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * world, 32, generator=g), torch.randn(4 * world, 8, generator=g)


def loss_of(m, x, y, dtype):
    return torch.nn.functional.mse_loss(m(x.to(dtype)).float(), y)


def fsdp_loss_scale(world, mesh=None):
    """1, or ``1 / world`` where this torch's FSDP2 sums the ranks'
    gradients on gloo instead of averaging them (torch 2.8:
    pytorch#162338; 2.15 averages): the sharded models' losses are scaled
    by it, so the comparisons below test npukern's optimizer on every torch
    (scaling by a power of two moves no bit). Probed on a Linear fed the
    same batch on every rank, sharded on `mesh` as the model is (torch 2.8
    averages on a (1, 2) HSDP mesh)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2 * world, bias=False)
    ref = copy.deepcopy(m)
    fully_shard(m, mesh=mesh)
    x = torch.ones(3, 4)
    m(x).sum().backward()
    ref(x).sum().backward()
    ratio = (m.weight.grad.full_tensor() / ref.weight.grad).mean().item()
    return 1.0 / world if abs(ratio - world) < 0.5 else 1.0


def ddp(rank, world, int8=False):
    dtype = torch.bfloat16
    # int8: 4096-element weights (8-bit moments), split masters.
    model = mlp(dtype, 128 if int8 else 64)
    ref = mlp(dtype, 128 if int8 else 64)
    dmodel = torch.nn.parallel.DistributedDataParallel(model)
    kw = dict(lr=1e-2, weight_decay=0.1, master_weights=True, max_grad_norm=0.5)
    if int8:
        kw.update(master_weights="split", state_dtype="int8")
    opt, ref_opt = AdamW(dmodel.parameters(), **kw), AdamW(ref.parameters(), **kw)
    for step in range(STEPS):
        x, y = batch(step, world)
        xs, ys = x.chunk(world), y.chunk(world)
        opt.zero_grad()
        loss_of(dmodel, xs[rank], ys[rank], dtype).backward()
        opt.step()
        # The same arithmetic in one process: each rank's gradient divided by
        # the world size, summed in rank order.
        ref_opt.zero_grad()
        acc = None
        for r in range(world):
            grads = torch.autograd.grad(loss_of(ref, xs[r], ys[r], dtype), list(ref.parameters()))
            grads = [g / world for g in grads]
            acc = grads if acc is None else [a + g for a, g in zip(acc, grads)]
        for p, g in zip(ref.parameters(), acc):
            p.grad = g
        ref_opt.step()
    same = all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(model.parameters(),
                                                                                       ref.parameters()))
    name = "master_low" if int8 else "master"
    masters = all(torch.equal(opt.state[a][name], ref_opt.state[b][name])
                  for a, b in zip(model.parameters(), ref.parameters()))
    if int8:
        masters = masters and all(torch.equal(opt.state[a][k], ref_opt.state[b][k])
                                  for a, b in zip(model.parameters(), ref.parameters()) for k in opt.state[a])
        assert opt.state[model[0].weight]["exp_avg"].dtype == torch.uint8
    return {"params_bit_identical": same, "masters_bit_identical": masters,
            "grad_norm": float(opt.grad_norm), "ref_grad_norm": float(ref_opt.grad_norm)}


def fsdp2(rank, world, mesh_shape=None):
    from torch.distributed.fsdp import fully_shard

    model = mlp(torch.float32)
    ref = mlp(torch.float32)
    mesh = None
    if mesh_shape is not None:  # HSDP: (replicate, shard)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kw = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    opt, ref_opt = AdamW(model.parameters(), **kw), AdamW(ref.parameters(), **kw)
    norms = []
    scale = fsdp_loss_scale(world, mesh)
    for step in range(STEPS):
        x, y = batch(step, world)
        xs, ys = x.chunk(world), y.chunk(world)
        opt.zero_grad()
        (loss_of(model, xs[rank], ys[rank], torch.float32) * scale).backward()
        opt.step()
        ref_opt.zero_grad()
        loss_of(ref, x, y, torch.float32).backward()
        ref_opt.step()
        norms.append((float(opt.grad_norm), float(ref_opt.grad_norm)))
    diff = 0.0
    for a, b in zip(model.parameters(), ref.parameters()):
        full = a.full_tensor() if hasattr(a, "full_tensor") else a
        diff = max(diff, (full.detach() - b.detach()).abs().max().item())
    norm_rel = max(abs(a - b) / b for a, b in norms)
    return {"max_param_diff": diff, "max_norm_rel": norm_rel}


def _gather_scales(t):
    """The ranks' block scales concatenated in rank order: a DTensor's
    whole (``Shard(0)``, rank r's at ``[r * padded, ...)``), or the ranks'
    plain tensors (one per 256-element block of the rank's shard)."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([t.numel()]))
    most = int(max(sizes).item())
    parts = [torch.zeros(most) for _ in range(world)]
    dist.all_gather(parts, torch.cat([t, torch.zeros(most - t.numel())]))
    return torch.cat([q[:int(n)] for q, n in zip(parts, sizes)])


def _whole(t):
    if not hasattr(t, "full_tensor"):
        return t
    if t.dtype != torch.int16:
        return t.full_tensor()
    from torch.distributed.tensor import DTensor  # gloo gathers no int16: as int32

    wide = DTensor.from_local(t.to_local().to(torch.int32), t.device_mesh, t.placements, shape=t.shape,
                              stride=t.stride())
    return wide.full_tensor().to(torch.int16)


def _bits(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def fsdp2_int8(rank, world, dtype, feed=False, hidden=128):
    """8-bit moments under ``fully_shard`` (hidden 128: shards of 2048
    elements of each 4096-element weight; hidden 129: the 129 x 32 weight cut
    at row 65, offset 2080, off the flat 256 grid, whole rows of the row
    grid), the clip inside the step; bf16 params with split masters, or
    float32 params.
    Against ``ref``, one process doing the ranks' arithmetic: each rank's
    chunk of the batch backward on its own, the gradients summed in rank
    order and divided by the world size (what FSDP2's reduce-scatter
    computes), and compared bit for bit: params, low halves, codes, scales
    (the ranks' concatenated), the small params' float32 moments, step
    counts and the norm. ``feed``: each step's sharded grads are set from
    ``ref``'s (cut by FSDP2's placements), the optimizer alone. Else FSDP2's
    own backward and reduce-scatter, and beside it ``full``, one process on
    the whole batch (one backward, its mean over 8 rows): how far that is."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    from npukern_torch.optim import _local_scales

    model, ref, full = mlp(dtype, hidden), mlp(dtype, hidden), mlp(dtype, hidden)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    kw = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, state_dtype="int8", seed=5)
    if dtype == torch.bfloat16:
        kw["master_weights"] = "split"
    opt, ref_opt, full_opt = AdamW(model.parameters(), **kw), AdamW(ref.parameters(), **kw), \
        AdamW(full.parameters(), **kw)
    scale = fsdp_loss_scale(world)
    norms_equal = True
    for step in range(STEPS):
        x, y = batch(step, world)
        xs, ys = x.chunk(world), y.chunk(world)
        ref_opt.zero_grad()
        per = [torch.autograd.grad(loss_of(ref, xs[r], ys[r], dtype), list(ref.parameters())) for r in range(world)]
        for i, p in enumerate(ref.parameters()):
            acc = per[0][i]
            for g in per[1:]:
                acc = acc + g[i]  # in rank order
            p.grad = acc / world
        opt.zero_grad()
        if feed:
            for p, r in zip(model.parameters(), ref.parameters()):
                p.grad = distribute_tensor(r.grad.detach().clone(), p.device_mesh, p.placements)
        else:
            (loss_of(model, xs[rank], ys[rank], dtype) * scale).backward()
            full_opt.zero_grad()
            loss_of(full, x, y, dtype).backward()
            full_opt.step()
        opt.step()
        ref_opt.step()
        norms_equal = norms_equal and bool(_bits(opt.grad_norm).eq(_bits(ref_opt.grad_norm)).all())
    differ, compared, q8 = {}, 0, 0
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        if not torch.equal(_bits(_whole(p.detach())), _bits(r.detach())):
            differ[name] = "param"
        st, rst = opt.state[p], ref_opt.state[r]
        if st.keys() != rst.keys():
            differ[name + " keys"] = sorted(st.keys() ^ rst.keys())
        for k in rst:
            # The ranks' own scales (a smaller shard's padding dropped).
            got = _gather_scales(_local_scales(p, st[k])) if k.endswith("_scale") else _whole(st[k])
            if got.shape != rst[k].shape or not torch.equal(_bits(got), _bits(rst[k])):
                differ[f"{name} {k}"] = int((got != rst[k]).sum()) if got.shape == rst[k].shape else "shape"
            compared += 1
        q8 += st["exp_avg"].dtype == torch.uint8
    assert q8 == 2, q8  # the two hidden x 32 weights
    res = {"differ": differ, "compared": compared, "norms_equal": norms_equal}
    if not feed:
        res["full_max_param_diff"] = max((_whole(a.detach()).float() - b.detach().float()).abs().max().item()
                                         for a, b in zip(model.parameters(), full.parameters()))
        res["full_codes_differ"] = sum(int((_whole(opt.state[a]["exp_avg"]) != full_opt.state[b]["exp_avg"]).sum())
                                       for a, b in zip(model.parameters(), full.parameters())
                                       if opt.state[a]["exp_avg"].dtype == torch.uint8)
        res["codes"] = 2 * 32 * hidden
    return res


def fsdp2_int8_dcp(rank, world):
    """torch.distributed.checkpoint of split masters + 8-bit moments under
    ``fully_shard``: 10 steps uninterrupted against 5 steps, the model's and
    optimizer's state dicts (``get_model_state_dict`` /
    ``get_optimizer_state_dict``) saved with ``dcp.save``, a fresh model and
    optimizer loaded (``dcp.load``, ``set_*_state_dict``) and 5 more steps:
    every param and state tensor bit for bit, after the load and at the end.
    Hidden 128: even shards of 2048 (the scales' whole is the unsharded
    param's 128, a block a row of 32); hidden 129: 65 + 64 rows of the first
    weight (65 and 64 blocks: the scales' whole is the unsharded param's
    129, each rank's its rows'). Also ``to_float32_state`` of the sharded
    state dict (DTensor codes decoded shard by shard) and that state loaded
    back into ``state_dtype="int8"`` (quantized on each rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from npukern_torch.optim import dequantize_moment, q8_scales_len, to_float32_state

    dtype = torch.bfloat16
    res = {}
    for hidden in (128, 129):
        def build():
            m = mlp(dtype, hidden)
            for layer in m:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            fully_shard(m)
            return m, AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=0.5, master_weights="split",
                            state_dtype="int8", seed=5)

        def train(m, o, steps):
            for step in steps:
                x, y = batch(step, world)
                o.zero_grad()
                loss_of(m, x.chunk(world)[rank], y.chunk(world)[rank], dtype).backward()
                o.step()

        def compare(a, ao, b, bo):
            differ = {}
            for (name, p), q in zip(a.named_parameters(), b.parameters()):
                if not torch.equal(_bits(_whole(p.detach())), _bits(_whole(q.detach()))):
                    differ[name] = "param"
                if ao.state[p].keys() != bo.state[q].keys():
                    differ[name + " keys"] = sorted(ao.state[p].keys() ^ bo.state[q].keys())
                for k in ao.state[p]:
                    x, y = ao.state[p][k], bo.state[q][k]
                    if type(x) is not type(y):
                        differ[f"{name} {k}"] = "type"
                        continue
                    x, y = (_whole(x), _whole(y))
                    if x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
                        differ[f"{name} {k}"] = int((x != y).sum()) if x.shape == y.shape else "shape"
            return differ

        whole_run, whole_opt = build()
        train(whole_run, whole_opt, range(STEPS))
        first, first_opt = build()
        train(first, first_opt, range(STEPS // 2))
        path = f"ckpt-{hidden}"
        osd = get_optimizer_state_dict(first, first_opt)
        dcp.save({"model": get_model_state_dict(first), "optim": osd}, checkpoint_id=path)
        scale = osd["state"]["0.weight"]["exp_avg_scale"]
        assert isinstance(scale, DTensor), type(scale)
        res[f"{hidden} scales"] = [tuple(scale.shape), scale.to_local().numel()]
        # A row of scales per row of the weight, cut as the weight: the whole
        # scales are the unsharded param's, even and uneven shards alike.
        assert scale.shape == (hidden, 1), scale.shape
        # to torch's float32 moments, shard by shard.
        f32 = to_float32_state(osd)["state"]["0.weight"]
        ea = f32["exp_avg"]
        assert isinstance(ea, DTensor) and ea.dtype == torch.float32 and "exp_avg_scale" not in f32
        codes = osd["state"]["0.weight"]["exp_avg"]
        blocks = q8_scales_len(codes.to_local().shape)  # the rank's own, its padding dropped
        assert torch.equal(ea.to_local(), dequantize_moment(codes.to_local(), scale.to_local().reshape(-1)[:blocks],
                                                            True))

        resumed, resumed_opt = build()
        sd = {"model": get_model_state_dict(resumed), "optim": get_optimizer_state_dict(resumed, resumed_opt)}
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(resumed, sd["model"])
        set_optimizer_state_dict(resumed, resumed_opt, sd["optim"])
        res[f"{hidden} after load"] = compare(first, first_opt, resumed, resumed_opt)
        train(resumed, resumed_opt, range(STEPS // 2, STEPS))
        res[f"{hidden} resumed"] = compare(whole_run, whole_opt, resumed, resumed_opt)

        # torch's float32 moments loaded into int8 under FSDP2: quantized on each rank.
        again, again_opt = build()
        set_model_state_dict(again, get_model_state_dict(first))
        set_optimizer_state_dict(again, again_opt, to_float32_state(get_optimizer_state_dict(first, first_opt)))
        st = again_opt.state[again[0].weight]
        assert st["exp_avg"].dtype == torch.uint8 and isinstance(st["exp_avg_scale"], DTensor)
        ref = first_opt.state[first[0].weight]
        res[f"{hidden} requantized exp_avg codes differ"] = int((_whole(st["exp_avg"]) != _whole(ref["exp_avg"])).sum())
        train(again, again_opt, range(STEPS // 2, STEPS))
    return res


def fsdp2_int8_full_state_dict(rank, world):
    """A full state dict (``StateDictOptions(full_state_dict=True)``) of
    float32 params with 8-bit moments under ``fully_shard`` after 5 steps,
    loaded into one process's model and optimizer; then 5 more steps, each
    fed the FSDP2 run's gathered gradients. Hidden 128 (even shards) and 129
    (65 + 64 rows): the full scales are the unsharded param's (``[rows,
    1]``), and the one process continues with the FSDP2 run's bits (params,
    codes, scales, moments). Then the one process's state loaded back into
    a fresh FSDP2 model and optimizer: the same bits, after the load and
    after 2 more steps."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard

    full = StateDictOptions(full_state_dict=True)
    kw = dict(lr=1e-2, weight_decay=0.1, state_dtype="int8", seed=5)
    res = {}

    def sharded(hidden):
        m = mlp(torch.float32, hidden)
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(m)
        return m, AdamW(m.parameters(), **kw)

    def differ_of(model, opt, one, one_opt):
        differ = {}
        for (name, p), q in zip(model.named_parameters(), one.parameters()):
            if not torch.equal(_bits(_whole(p.detach())), _bits(q.detach())):
                differ[name] = "param"
            for k, t in opt.state[p].items():
                got = _whole(t).reshape(-1) if k.endswith("_scale") else _whole(t)
                want = one_opt.state[q][k].reshape(-1) if k.endswith("_scale") else one_opt.state[q][k]
                if got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
                    differ[f"{name} {k}"] = "shape" if got.shape != want.shape else int((got != want).sum())
        return differ

    for hidden in (128, 129):
        model, opt = sharded(hidden)

        def step(s, one=None, one_opt=None):
            x, y = batch(s, world)
            opt.zero_grad()
            loss_of(model, x.chunk(world)[rank], y.chunk(world)[rank], torch.float32).backward()
            if one is not None:
                for p, q in zip(model.parameters(), one.parameters()):
                    q.grad = p.grad.full_tensor()
                one_opt.step()
            opt.step()

        for s in range(STEPS // 2):
            step(s)
        osd = get_optimizer_state_dict(model, opt, options=full)
        res[f"{hidden} full scales"] = list(osd["state"]["0.weight"]["exp_avg_scale"].shape)
        one = mlp(torch.float32, hidden)
        one.load_state_dict(get_model_state_dict(model, options=full))
        one_opt = AdamW(one.parameters(), **kw)
        # A copy: the full dict's step counts are the live optimizer's own
        # tensors (torch's loaders keep them as given), stepped twice else.
        set_optimizer_state_dict(one, one_opt, copy.deepcopy(osd), options=full)
        for s in range(STEPS // 2, STEPS):
            step(s, one, one_opt)
        res[f"{hidden} differ"] = differ_of(model, opt, one, one_opt)
        # And back: the one process's state (flat scales) into a fresh FSDP2
        # model and optimizer, then 2 steps of its own beside the one
        # process fed its gradients.
        model, opt = sharded(hidden)
        set_model_state_dict(model, one.state_dict(), options=full)
        set_optimizer_state_dict(model, opt, copy.deepcopy(get_optimizer_state_dict(one, one_opt)), options=full)
        res[f"{hidden} back after load"] = differ_of(model, opt, one, one_opt)
        for s in range(STEPS, STEPS + 2):
            step(s, one, one_opt)
        res[f"{hidden} back differ"] = differ_of(model, opt, one, one_opt)
    return res


def fsdp2_int8_hf(rank, world):
    """A Hugging Face Llama, ``hf.patch``ed, bf16, ``fully_shard`` per
    decoder layer and at the root, stepped with split masters, 8-bit moments
    and the clip; beside it one process fed the FSDP2 run's gathered
    gradients. Odd sizes (hidden 72, intermediate 100, vocab 99): the
    embedding and LM head cut at row 50 (offset 3600), the projections at
    rows 36 and 50, none on the flat 256 grid. Params, low halves, codes,
    scales and moments after 4 steps."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from torch.distributed.fsdp import fully_shard

    from npukern_torch import hf

    cfg = LlamaConfig(hidden_size=72, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=99, max_position_embeddings=64)

    def build():
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
        hf.patch(m)
        return m

    model, ref = build(), build()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    kw = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, master_weights="split", state_dtype="int8", seed=5)
    opt, ref_opt = AdamW(model.parameters(), **kw), AdamW(ref.parameters(), **kw)
    for step in range(4):
        ids = torch.randint(0, cfg.vocab_size, (2 * world, 16), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        mine = ids.chunk(world)[rank]
        model(input_ids=mine, labels=mine).loss.backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.full_tensor()
        opt.step()
        ref_opt.step()
    differ, q8 = {}, 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if not torch.equal(_bits(_whole(p.detach())), _bits(q.detach())):
            differ[name] = "param"
        for k, t in opt.state[p].items():
            got = _whole(t).reshape(-1) if k.endswith("_scale") else _whole(t)
            want = ref_opt.state[q][k]
            if got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
                differ[f"{name} {k}"] = "shape" if got.shape != want.shape else int((got != want).sum())
        q8 += opt.state[p]["exp_avg"].dtype == torch.uint8
    return {"differ": differ, "q8": q8}


def main():
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        modes = {"ddp": ddp, "fsdp2": fsdp2, "hsdp12": lambda r, w: fsdp2(r, w, (1, 2)),
                 "hsdp21": lambda r, w: fsdp2(r, w, (2, 1)), "ddp_int8": lambda r, w: ddp(r, w, True),
                 "fsdp2_int8_bf16": lambda r, w: fsdp2_int8(r, w, torch.bfloat16),
                 "fsdp2_int8_float32": lambda r, w: fsdp2_int8(r, w, torch.float32),
                 "fsdp2_int8_same_grads": lambda r, w: fsdp2_int8(r, w, torch.bfloat16, feed=True),
                 "fsdp2_int8_same_grads_129": lambda r, w: fsdp2_int8(r, w, torch.bfloat16, feed=True, hidden=129),
                 "fsdp2_int8_bf16_129": lambda r, w: fsdp2_int8(r, w, torch.bfloat16, hidden=129),
                 "fsdp2_int8_dcp": fsdp2_int8_dcp, "fsdp2_int8_full_state_dict": fsdp2_int8_full_state_dict,
                 "fsdp2_int8_hf": fsdp2_int8_hf}
        res = modes[mode](rank, world)
        res["ok"] = True
    except Exception as e:  # reported to the test, which shows it
        import traceback

        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
