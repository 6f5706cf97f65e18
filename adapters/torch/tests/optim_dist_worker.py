"""One rank of test_optim_dist.py (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
in the environment; gloo). Mode ``ddp``: a bf16 MLP under
DistributedDataParallel stepped by npukern's AdamW (master weights, the clip
inside the step) against the same model in this process fed the ranks'
averaged gradients (DDP divides each by the world size and all-reduces:
g0 / 2 + g1 / 2, exact) -- bitwise equal after 10 steps. Mode ``fsdp2``:
the float32 MLP under ``fully_shard`` (DTensor shards) against the
unsharded model in this process on the full batch -- within the bound the
test states; the clip's norm is all-reduced across the shards. Writes JSON
to argv[2]."""

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


def fsdp2(rank, world, mesh_shape=None, int8=False):
    from torch.distributed.fsdp import fully_shard

    # int8: 4096-element weights, 8-bit moments in shards of 2048 elements
    # (offsets multiples of the 256-element block).
    model = mlp(torch.float32, 128 if int8 else 64)
    ref = mlp(torch.float32, 128 if int8 else 64)
    mesh = None
    if mesh_shape is not None:  # HSDP: (replicate, shard)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kw = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=0.5)
    if int8:
        kw["state_dtype"] = "int8"
    opt, ref_opt = AdamW(model.parameters(), **kw), AdamW(ref.parameters(), **kw)
    norms = []
    for step in range(STEPS):
        x, y = batch(step, world)
        xs, ys = x.chunk(world), y.chunk(world)
        opt.zero_grad()
        loss_of(model, xs[rank], ys[rank], torch.float32).backward()
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
    res = {"max_param_diff": diff, "max_norm_rel": norm_rel}
    if int8:
        st, rst = opt.state[model[0].weight], ref_opt.state[ref[0].weight]
        assert st["exp_avg"].to_local().dtype == torch.uint8
        codes = st["exp_avg"].full_tensor()
        res["codes_differ"] = int((codes != rst["exp_avg"]).sum())
        res["codes"] = codes.numel()
    return res


def main():
    mode, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        modes = {"ddp": ddp, "fsdp2": fsdp2, "hsdp12": lambda r, w: fsdp2(r, w, (1, 2)),
                 "hsdp21": lambda r, w: fsdp2(r, w, (2, 1)), "ddp_int8": lambda r, w: ddp(r, w, True),
                 "fsdp2_int8": lambda r, w: fsdp2(r, w, int8=True)}
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
