"""``torch.optim.AdamW`` / ``Adam`` stepped by npukern's multi-tensor AdamW
(``torch.ops.npukern.adamw_``, the C ABI's ``npk_adamw``): one pass over
params, grads and moments per bucket of tensors that share dtypes, with two
additions torch's optimizer does not have:

- ``master_weights=True``: float32 master copies of 16-bit params live in the
  optimizer state (``state[p]["master"]``) with float32 moments; the step
  updates the master and writes the param as the master rounded once, so a
  bf16 model needs no autocast casts and loses no update below bf16's step.
- ``max_grad_norm``: the global L2 norm of every gradient (f64 sum of squares,
  npukern's ``grad_stats``; under FSDP2 the shards' sums all-reduced once)
  and torch's clip coefficient applied inside the step: clip + step read each gradient twice and never write it. A
  non-finite norm skips the step (params, masters, moments and step counts
  unchanged). The norm before clipping is ``optimizer.grad_norm`` afterwards
  (a float32 tensor, what Trainer logs).

Numerics: the update's formula and order are torch's fused CPU AdamW's, in
float32 without FMA, the same bits on every ISA and thread count; within a few
float32 ulp of float64 AdamW per step (``tests/adamw.rs``). Not bitwise equal
to torch's (whose vector code may fuse multiply-adds).
"""

import warnings

import torch

from ._dtypes import KERNEL_DTYPES

AMSGRAD, MAXIMIZE, L2, CLIP, GRAD_SCALE, FOUND_INF, CLIP_COEF = 1, 2, 4, 8, 16, 32, 64
_SIXTEEN = (torch.bfloat16, torch.float16)


def _value(x):
    return x.item() if isinstance(x, torch.Tensor) else x


def _dtensor_cls():
    try:
        from torch.distributed.tensor import DTensor

        return DTensor
    except ImportError:  # torch built without distributed
        return None


_DTENSOR = _dtensor_cls()


def _local(t):
    """The rank's own elements of a DTensor (FSDP2's sharded params, grads and
    state; updated in place), or the tensor itself."""
    return t.to_local() if _DTENSOR is not None and isinstance(t, _DTENSOR) else t


def _sharded(t):
    return _DTENSOR is not None and isinstance(t, _DTENSOR) and any(pl.is_shard() for pl in t.placements)


def _kernel_view(g):
    """The rank's gradient as npukern's grad_stats reads it (complex as real
    pairs), or None for float64, which it does not take."""
    g = _local(g)
    if g.is_complex():
        g = torch.view_as_real(g)
    return g if g.dtype in KERNEL_DTYPES else None


def _stats(grads):
    """[sum of squares, NaN count, Inf count] of local gradients, float64."""
    total = torch.zeros(3, dtype=torch.float64)
    kern = [v for v in (_kernel_view(g) for g in grads) if v is not None]
    if kern:
        total += torch.ops.npukern.grad_stats(kern)[:3]
    for g in grads:
        if _kernel_view(g) is None:  # float64: torch's own sums
            g = _local(g)
            g = torch.view_as_real(g) if g.is_complex() else g
            total += torch.stack([g.double().square().sum(), g.isnan().sum().double(), g.isinf().sum().double()])
    return total


def _sum_sq(grads):
    """[sum of squares, NaN count, Inf count] over every gradient, in float64:
    a DTensor sharded across ranks (FSDP2) contributes its local shard and the
    shards' sums are all-reduced over the mesh dims it is sharded on (HSDP's
    2-D mesh: its shard dim; the replicas hold the same gradients); other
    gradients are whole on each rank (one process, or DDP after its
    all-reduce) and count once."""
    by_mesh = {}
    for g in grads:
        if _sharded(g):
            dims = tuple(i for i, pl in enumerate(g.placements) if pl.is_shard())
            by_mesh.setdefault((id(g.device_mesh), dims), (g.device_mesh, dims, []))[2].append(g)
    total = _stats([g for g in grads if not _sharded(g)])
    for mesh, dims, gs in by_mesh.values():
        s = _stats(gs)
        for d in dims:
            torch.distributed.all_reduce(s, group=mesh.get_group(mesh_dim=d))
        total += s
    return total


class AdamW(torch.optim.Optimizer):
    """Drop-in for :class:`torch.optim.AdamW` (same constructor, param groups,
    LR schedulers -- a tensor ``lr`` too --, ``state_dict`` interchangeable with
    torch's in both directions, ``zero_grad``, closures). ``foreach`` and
    ``fused`` are accepted and ignored (the step is always one fused pass);
    ``capturable`` and ``differentiable`` must be False. See the module docs
    for ``master_weights`` and ``max_grad_norm``."""

    _decoupled = True

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        master_weights=False,
        max_grad_norm=None,
        decoupled_weight_decay=None,
    ):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not 0.0 <= _value(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
            raise ValueError("betas must be either both floats or both Tensors")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if capturable or differentiable:
            raise ValueError("npukern_torch.optim: capturable and differentiable are not supported")
        if max_grad_norm is not None and not float(max_grad_norm) >= 0.0:
            raise ValueError(f"Invalid max_grad_norm: {max_grad_norm}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=False,
            differentiable=False,
            fused=fused,
            # torch's Adam and AdamW key (AdamW: always True); each group's own rules its step.
            decoupled_weight_decay=self._decoupled if decoupled_weight_decay is None else bool(decoupled_weight_decay),
        )
        super().__init__(params, defaults)
        self.master_weights = bool(master_weights)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.grad_norm = None
        self._hooks()
        self._advise()

    def _advise(self):
        """Says once what a new user would otherwise not learn: masters asked
        for with no 16-bit params, and float16 params without loss scaling."""
        dtypes = {p.dtype for g in self.param_groups for p in g["params"]}
        if self.master_weights and not dtypes & set(_SIXTEEN):
            warnings.warn("npukern_torch.optim: master_weights=True keeps float32 masters of bfloat16/float16 "
                          "params only, and these params are all " + ", ".join(sorted(map(str, dtypes))) +
                          " (a float32 model, or peft's float32 LoRA adapters): it changes nothing here",
                          stacklevel=3)
        if torch.float16 in dtypes:
            warnings.warn("npukern_torch.optim: float16 params: gradients below float16's range (6e-8) become 0 "
                          "without loss scaling; scale the loss (torch.amp.GradScaler works with this optimizer) "
                          "or train in bfloat16", stacklevel=3)

    # What torch's Optimizer.__getstate__ drops (it keeps defaults, state and
    # param groups): copy.deepcopy, pickle and torch.save keep these too.
    _OWN = ("master_weights", "max_grad_norm", "grad_norm")

    def _hooks(self):
        self.register_load_state_dict_pre_hook(AdamW._keep_float32)
        self.register_load_state_dict_post_hook(AdamW._restore_float32)

    def __getstate__(self):
        state = super().__getstate__()
        state.update({k: self.__dict__.get(k) for k in self._OWN})
        return state

    def __setstate__(self, state):
        hooks = "_optimizer_load_state_dict_pre_hooks" in state
        super().__setstate__(state)
        for k in self._OWN:
            self.__dict__.setdefault(k, None if k != "master_weights" else False)
        if not hooks:
            self._hooks()
        for g in self.param_groups:
            g.setdefault("amsgrad", False)
            g.setdefault("maximize", False)
            g.setdefault("decoupled_weight_decay", self._decoupled)

    # torch's load_state_dict casts every state tensor to its param's dtype,
    # which would round masters and float32 moments to bf16: keep them.
    # References, not copies (a copy of every state tensor raised a resume's
    # peak by the whole optimizer state; torch's own load copies nothing
    # whose dtype already matches): only the float32 tensors torch would
    # cast, the loaded dict's own, as torch's load keeps them.
    @staticmethod
    def _keep_float32(opt, state_dict):
        opt._incoming = {
            k: {n: t for n, t in s.items()
                if isinstance(t, torch.Tensor) and n != "step" and t.dtype == torch.float32}
            for k, s in state_dict["state"].items()
        }
        return None

    @staticmethod
    def _restore_float32(opt):
        incoming = getattr(opt, "_incoming", {})
        ids = [p for g in opt.param_groups for p in g["params"]]
        for k, saved in incoming.items():
            p = ids[k] if isinstance(k, int) and k < len(ids) else None
            if p is None or p not in opt.state:
                continue
            st = opt.state[p]
            for n, t in saved.items():
                if t.dtype == torch.float32 and st[n].dtype != torch.float32:
                    st[n] = t.to(p.device)
        # Under master_weights a 16-bit param's master and moments are float32
        # (the docs' promise), whatever the state came from: torch's AdamW
        # casts a master it carried to the param's dtype, and its own state
        # has 16-bit moments.
        if opt.master_weights:
            for p, st in opt.state.items():
                if p.dtype in _SIXTEEN:
                    for n in ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                        if n in st and isinstance(st[n], torch.Tensor) and st[n].dtype != torch.float32:
                            st[n] = st[n].float()
        opt._incoming = {}

    def _init_state(self, p, group):
        st = self.state[p]
        if st:
            if self.master_weights and p.dtype in _SIXTEEN:
                if "master" not in st:
                    # A torch AdamW state loaded into this optimizer.
                    st["master"] = p.detach().float()
                for n in ("master", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if n in st and st[n].dtype != torch.float32:
                        st[n] = st[n].float()
            if group["amsgrad"] and "max_exp_avg_sq" not in st:
                st["max_exp_avg_sq"] = torch.zeros_like(st["exp_avg_sq"])
            return st
        master = self.master_weights and p.dtype in _SIXTEEN
        moment = torch.float32 if master else p.dtype
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        st["exp_avg"] = torch.zeros_like(p, dtype=moment, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, dtype=moment, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            st["max_exp_avg_sq"] = torch.zeros_like(p, dtype=moment, memory_format=torch.preserve_format)
        if master:
            st["master"] = p.detach().float()
        return st

    def _grads(self):
        out = []
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and not p.grad.is_meta:  # a meta grad has no norm to add
                    if p.grad.is_sparse:
                        raise RuntimeError("npukern_torch.optim.AdamW does not support sparse gradients")
                    out.append(p.grad)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """One step over every group. Every group is checked before anything
        is written (a later group's bad lr or param leaves the earlier ones
        and every step count as they were). With ``max_grad_norm`` the norm
        is taken once over all groups' gradients, and a non-finite one skips
        the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans = [self._plan(group) for group in self.param_groups]
        if sum(len(b) for b in plans) > 1:  # one kernel call checks its own lists
            _check_disjoint(plans)
        grads = self._grads()
        coef = None
        if self.max_grad_norm is not None:
            stats = _sum_sq(grads)
            nonfinite = bool(stats[1] > 0 or stats[2] > 0)
            norm = float("nan") if stats[1] > 0 else (float("inf") if nonfinite else float(stats[0].sqrt()))
            self.grad_norm = torch.tensor(norm, dtype=torch.float32)
            if nonfinite:
                return loss
            c = self.max_grad_norm / (norm + 1e-6)
            coef = float(torch.tensor(min(c, 1.0), dtype=torch.float32))
        for group, plan in zip(self.param_groups, plans):
            self._run(group, plan, coef)
        return loss

    def _plan(self, group):
        """The group's buckets (params sharing dtypes and a step), checked:
        nothing is written and no step count moves here."""
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        lr = float(_value(lr))
        if not lr >= 0.0 or lr == float("inf"):
            raise ValueError(f"npukern_torch.optim.AdamW: lr {lr} is not a finite value >= 0")
        buckets = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            local = _local(p)
            if local.device.type not in ("cpu", "meta"):
                raise TypeError(f"npukern_torch.optim.AdamW: params must be CPU tensors (got one on {p.device})")
            real = p.dtype.to_real() if p.is_complex() else p.dtype
            if real not in KERNEL_DTYPES + (torch.float64,) or p.grad.dtype != p.dtype:
                raise TypeError(
                    f"npukern_torch.optim.AdamW: params must be float32/bfloat16/float16/float64 (or complex) "
                    f"with grads of their dtype (got {p.dtype}, grad {p.grad.dtype})"
                )
            st = self._init_state(p, group)
            if local.is_meta:  # shapes only (a dry run, deferred init): torch's own step, as torch's AdamW
                real = "meta"
            key = (real, st["exp_avg"].dtype, "master" in st, float(st["step"]) + 1)
            buckets.setdefault(key, []).append((p, st))
        return buckets

    def _run(self, group, buckets, coef):
        b1, b2 = group["betas"]
        decoupled = group.get("decoupled_weight_decay", self._decoupled)
        flags = (AMSGRAD if group["amsgrad"] else 0) | (MAXIMIZE if group["maximize"] else 0)
        flags |= 0 if decoupled else L2
        if coef is not None:
            flags |= CLIP_COEF
        lr = float(_value(group["lr"]))
        for (real, _, has_master, step), items in buckets.items():
            if real == torch.float64 or real == "meta":
                self._run_float64(group, items, coef, decoupled)
                continue
            torch.ops.npukern.adamw_(
                [_flat(p) for p, _ in items],
                [_flat(p.grad) for p, _ in items],
                [_flat(s["exp_avg"]) for _, s in items],
                [_flat(s["exp_avg_sq"]) for _, s in items],
                [_flat(s["max_exp_avg_sq"]) for _, s in items] if group["amsgrad"] else [],
                [_flat(s["master"]) for _, s in items] if has_master else [],
                lr,
                float(b1),
                float(b2),
                float(group["eps"]),
                float(group["weight_decay"]),
                int(step),
                flags,
                0.0,
                1.0,
                0.0,
                1.0 if coef is None else coef,
            )
            for _, st in items:
                st["step"] += 1

    @staticmethod
    def _run_float64(group, items, coef, decoupled):
        """float64 (and complex128) params: torch's own single-tensor Adam (npukern's
        kernel is float32 inside), the clip applied to a scaled copy of each gradient.
        Meta params too (no elements: what torch's AdamW does with them), their
        masters stepped in the param's place and copied back."""
        from torch.optim.adam import adam

        b1, b2 = group["betas"]
        stepped = [s.get("master", p) for p, s in items]
        grads = [(p.grad if coef is None else p.grad * coef).to(w.dtype) for (p, _), w in zip(items, stepped)]
        adam(stepped, grads, [s["exp_avg"] for _, s in items], [s["exp_avg_sq"] for _, s in items],
             [s["max_exp_avg_sq"] for _, s in items] if group["amsgrad"] else [],
             [s["step"] for _, s in items], foreach=False, has_complex=any(p.is_complex() for p, _ in items),
             decoupled_weight_decay=decoupled, amsgrad=group["amsgrad"], beta1=b1, beta2=b2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
        for (p, _), w in zip(items, stepped):
            if w is not p:
                p.copy_(w)


def _span(t):
    """The bytes [lo, hi) a tensor's elements lie in, and whether it is dense."""
    lo = t.data_ptr()
    if t.is_contiguous():
        return lo, lo + t.nbytes, True
    if t.is_complex():
        t = torch.view_as_real(t)
    last = sum((n - 1) * max(st, 0) for n, st in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * t.element_size(), False


def _check_disjoint(plans):
    """What the kernel checks of its own lists, across the step's calls (the
    buckets of every group): no param shares memory with another param or a
    grad of the step (two Parameters over one base, in two groups or two
    dtype buckets, would lose an update). Views of one base that interleave
    (a split along columns) are refused as the kernel refuses them: their
    elements cannot be told apart cheaply. The moments and masters are the
    optimizer's own tensors; the kernel checks them within each call. Runs
    before the first write."""
    spans = []
    for g, buckets in enumerate(plans):
        for items in buckets.values():
            for p, _ in items:
                if p.is_meta or p.numel() == 0:
                    continue
                local, grad = _local(p), _local(p.grad)
                shape = tuple(p.shape)
                spans.append((*_span(local), True, f"param of shape {shape} in group {g}"))
                spans.append((*_span(grad), False, f"grad of the param of shape {shape} in group {g}"))
    spans.sort(key=lambda s: s[0])
    for i, (lo, hi, dense, written, what) in enumerate(spans):
        for j in range(i + 1, len(spans)):
            lo2, _, dense2, written2, what2 = spans[j]
            if lo2 >= hi:
                break
            if written or written2:
                how = "" if dense and dense2 else " (interleaved views)"
                raise ValueError(
                    f"npukern_torch.optim.AdamW: the {what} and the {what2} share memory{how}; each param "
                    "and grad must have its own (nothing was written)"
                )


def _flat(t):
    """The rank's elements as the kernel reads them: complex as its real
    pairs (torch's AdamW steps ``view_as_real``), and flat when contiguous (any
    number of dims; the op sees elements, not shapes)."""
    t = _local(t)
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(-1) if t.is_contiguous() else t


class Adam(AdamW):
    """Drop-in for :class:`torch.optim.Adam` (L2 weight decay, default 0;
    ``decoupled_weight_decay=True`` is AdamW's, as torch's Adam takes it),
    with :class:`AdamW`'s ``master_weights`` and ``max_grad_norm``."""

    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, **kw):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kw)
