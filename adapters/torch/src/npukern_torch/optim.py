"""``torch.optim.AdamW`` / ``Adam`` stepped by npukern's multi-tensor AdamW
(``torch.ops.npukern.adamw_``, the C ABI's ``npk_adamw``): one pass over
params, grads and moments per bucket of tensors that share dtypes, with two
additions torch's optimizer does not have:

- ``master_weights=True``: float32 master copies of 16-bit params live in the
  optimizer state (``state[p]["master"]``) with float32 moments; the step
  updates the master and writes the param as the master rounded once, so a
  bf16 model needs no autocast casts and loses no update below bf16's step.
- ``master_weights="split"`` (bfloat16 params): the float32 master kept as
  the bf16 param (the master rounded to nearest, ties away from zero) plus
  its low 16 bits (``state[p]["master_low"]``, int16): the same masters and
  moments as ``master_weights=True`` bit for bit, in 2 bytes instead of 4.
- ``state_dtype=torch.bfloat16``: both moments in bfloat16, rounded
  stochastically with a counter-based hash of (``seed``, step, the
  element's index among all params), the same bits on every ISA, thread
  count and shard cut.
- ``state_dtype="int8"``: 8-bit moments, blockwise quantized (the
  library's ``quantized_moments``): ``exp_avg`` / ``exp_avg_sq`` (and
  ``max_exp_avg_sq``) are ``torch.uint8`` codes, one per element, in the
  param's shape, beside float32 scales ``exp_avg_scale`` /
  ``exp_avg_sq_scale`` (/ ``max_exp_avg_sq_scale``), one per block of 256
  elements of each row (``q8_row``: a param of two or more dims is cut
  into its dim-0 slices, each into blocks of 256 from its first element,
  the last one shorter; ``q8_scales_len(shape)`` scales, ``ceil(numel /
  256)`` for a 1-D param or rows of a multiple of 256). No block crosses a
  row, so a DTensor shard (FSDP2, dim 0) holds whole blocks wherever it is
  cut and quantizes as one process does; its scales are a DTensor too, see
  ``_scale_layout``: as ``[rows, ceil(row / 256)]`` placed as the param,
  so torch.distributed.checkpoint saves and loads them exactly and a full
  state dict holds the unsharded param's scales. A code is a
  small float relative to its block's largest |value| (exp_avg: sign, 4
  exponent, 3 mantissa bits; exp_avg_sq: 5 + 3), rounded stochastically
  from the hash of (``seed``, step, the element's key): the same bits on
  every ISA and thread count. A positive exp_avg_sq is never rounded to 0
  (its smallest code instead). Params with fewer than 4096 elements keep
  float32 moments (bitsandbytes' ``min_8bit_size``: biases and norms, a
  small part of the state, stay exact). float64 and complex params keep
  moments of their dtype. Split masters + int8 moments hold ~8.03 bytes
  per parameter (param, grad, low half, two codes, scales),
  ``stochastic_rounding=True`` + int8 ~6.03. ``state_dict()`` keeps the
  codes (an exact resume); float moments loaded (torch's AdamW state, or
  another ``state_dtype``'s) are quantized by the library
  (``quantize_moments``), codes loaded into another format decoded; for
  torch's AdamW, load ``to_float32_state(opt.state_dict())`` (torch's own
  loader would cast the raw codes to numbers).
- ``stochastic_rounding=True`` (bfloat16 params, no masters): the update is
  added in float32 and the param rounded stochastically (same hash): no
  master at all.
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

import math
import warnings

import torch

from ._dtypes import KERNEL_DTYPES

AMSGRAD, MAXIMIZE, L2, CLIP, GRAD_SCALE, FOUND_INF, CLIP_COEF = 1, 2, 4, 8, 16, 32, 64
SR_MOMENTS, SR_PARAMS = 1, 2  # npk_adamw_formats.rounding
_SIXTEEN = (torch.bfloat16, torch.float16)
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
Q8_BLOCK = 256  # elements per 8-bit moment block (one float32 scale each)
Q8_MIN_NUMEL = 4096  # smaller params keep float32 moments under state_dtype="int8"
_SCALE = {n: n + "_scale" for n in _MOMENTS}


def split_master(master):
    """A float32 master as (bf16 param, int16 low half), the kernel's split:
    the param is the master rounded to nearest with ties away from zero, and
    ``join_master`` of the pair is the master exactly (NaN: a quiet NaN)."""
    b = master.detach().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    hi = (b + 0x8000) >> 16
    hi = torch.where(master.isnan(), (b >> 16) | 0x40, hi)
    lo = torch.where(master.isnan(), torch.zeros_like(b), b - (hi << 16))
    as16 = lambda x: torch.where(x >= 0x8000, x - 0x10000, x).to(torch.int16)  # noqa: E731
    return as16(hi).view(torch.bfloat16).view(master.shape), lo.to(torch.int16).view(master.shape)


def join_master(param, low):
    """The float32 master of a split pair (a bf16 param and its int16 low half)."""
    hi = param.detach().contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    b = ((hi << 16) + low.to(torch.int64)) & 0xFFFFFFFF
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32).view(param.shape)


def _q8_magnitudes(signed):
    """The 256 codes' magnitudes relative to their block's scale (exact; the
    library's ``q8_magnitude``): exp_avg ``s eeee fff`` = ``2^(e-15) (1 +
    f/8)``, exp_avg_sq ``eeeee fff`` = ``2^(e-31) (1 + f/8)``, ``e = 0``: 0."""
    c = torch.arange(256, dtype=torch.int64)
    e = (c >> 3) & 15 if signed else c >> 3
    bits = torch.where(e == 0, 0, ((e + (112 if signed else 96)) << 23) | ((c & 7) << 20))
    if signed:
        bits = bits | ((c >> 7) << 31)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return bits.to(torch.int32).view(torch.float32)


def _row_len(shape):
    """The 8-bit blocks' row length for a tensor of ``shape``: a dim-0 slice
    of two or more dims, else 0 (one row)."""
    return math.prod(shape) // shape[0] if len(shape) >= 2 and shape[0] > 0 else 0


def q8_row(t):
    """The row length of ``t``'s 8-bit moment blocks (the kernel's
    ``q8_rows``): a dim-0 slice of a tensor of two or more dims, so that no
    block crosses a row and a dim-0 shard (FSDP2) holds whole blocks
    wherever it is cut; 0 (the whole tensor one row) otherwise. Blocks are
    256 elements from each row's first, a row's last one shorter."""
    return _row_len(_local(t).shape)


def q8_scales_len(shape):
    """How many block scales a moment of this shape has: ``rows *
    ceil(row / 256)`` (``q8_row``), ``ceil(numel / 256)`` for one row."""
    n, row = math.prod(shape), _row_len(shape)
    return n // row * -(-row // Q8_BLOCK) if row else -(-n // Q8_BLOCK)


def _block_index(shape, scales):
    """Each element's block (its scale's index) for a moment of ``shape``
    with ``scales`` scales: the row grid (``q8_row``), or one row when only
    that count fits (a state saved before row lengths, ABI 2.12)."""
    n, row = math.prod(shape), _row_len(shape)
    i = torch.arange(n, dtype=torch.int64)
    if not row or scales != q8_scales_len(shape) and scales == -(-n // Q8_BLOCK):
        return i // Q8_BLOCK
    return i // row * -(-row // Q8_BLOCK) + i % row // Q8_BLOCK


def dequantize_moment(codes, scales, signed):
    """The float32 values of 8-bit moment codes (``signed``: exp_avg's code
    map; else exp_avg_sq's), as the step decodes them: ``scale * magnitude``,
    one float32 multiply (a non-finite block decodes to NaN), the blocks
    on ``codes``' row grid (``q8_row``). In ``codes``' shape."""
    if _DTENSOR is not None and isinstance(codes, _DTENSOR):  # FSDP2: each rank decodes its shard
        local = codes.to_local()
        return _like(codes, dequantize_moment(local, _local(scales).reshape(-1)[:q8_scales_len(local.shape)], signed))
    n, want = codes.numel(), q8_scales_len(codes.shape)
    if _DTENSOR is None or not isinstance(scales, _DTENSOR):
        if scales.numel() not in (want, -(-n // Q8_BLOCK)):
            # e.g. a full_state_dict of uneven FSDP2 shards: each rank's
            # blocks padded to the largest shard's, not the whole param's.
            raise ValueError(f"dequantize_moment: {scales.numel()} scales for {n} codes of shape "
                             f"{tuple(codes.shape)}, want {want} (one per 256 of each row); decode each "
                             f"rank's shard with its own scales")
    flat = scales.float().reshape(-1)
    s = flat[_block_index(codes.shape, min(flat.numel(), want))] if n else flat[:0]
    return (s * _q8_magnitudes(signed)[codes.reshape(-1).long()]).view(codes.shape)


def quantize_moments(exp_avg, exp_avg_sq, max_exp_avg_sq=None, *, seed=0, step=1, key=0):
    """Float moments (torch's AdamW state) as 8-bit codes and scales, by the
    library's own quantizer: one npukern AdamW step with lr 0 and betas 0
    from zero state, whose new moments are the gradient it is given (exp_avg
    = g exactly; exp_avg_sq = g*g with g = sqrt(exp_avg_sq), within a float32
    ulp or two of the value before its 3-bit mantissa rounding). Rounding is
    the step's: stochastic from (``seed``, ``step``, ``key`` + element
    index), deterministic. Returns ``{name: (codes, scales)}`` per moment
    given, codes ``torch.uint8`` in each moment's shape."""
    given = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if max_exp_avg_sq is not None:
        given["max_exp_avg_sq"] = max_exp_avg_sq
    n = exp_avg.numel()
    nb = q8_scales_len(exp_avg.shape)
    grads = [exp_avg.detach().float().reshape(-1)]
    grads += [t.detach().float().reshape(-1).sqrt() for k, t in given.items() if k != "exp_avg"]
    k = len(grads)  # tensor 0's exp_avg, then tensor i's exp_avg_sq (i >= 1)
    params = [torch.zeros(n) for _ in range(k)]
    m = [torch.zeros(n, dtype=torch.uint8) for _ in range(k)]
    v = [torch.zeros(n, dtype=torch.uint8) for _ in range(k)]
    ms = [torch.zeros(nb) for _ in range(k)]
    vs = [torch.zeros(nb) for _ in range(k)]
    torch.ops.npukern.adamw_(params, grads, m, v, [], [], 0.0, 0.0, 0.0, 1e-8, 0.0, max(1, int(step)), 0, 0.0, 1.0,
                             0.0, 1.0, ms, vs, [], 0, 0, int(seed), [int(key)] * k, 1, [q8_row(exp_avg)] * k)
    out = {"exp_avg": (m[0], ms[0])}
    for i, name in enumerate(n for n in given if n != "exp_avg"):
        out[name] = (v[i + 1], vs[i + 1])
    return {name: (c.view(given[name].shape), s) for name, (c, s) in out.items()}


def to_float32_state(state_dict):
    """An optimizer ``state_dict`` with 8-bit moments (``state_dtype="int8"``)
    as torch's AdamW keeps it: each code tensor decoded to float32 (what the
    next step would decode) and the ``*_scale`` entries dropped; everything
    else (steps, masters, groups) as it is, shared with ``state_dict``. For
    ``torch.optim.AdamW.load_state_dict`` (torch casts float32 moments to
    the param's dtype) or any reader that expects float moments."""
    state = {}
    for k, st in state_dict["state"].items():
        st = dict(st)
        for n in _MOMENTS:
            t = st.get(n)
            if isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and _SCALE[n] in st:
                st[n] = dequantize_moment(t, st.pop(_SCALE[n]), n == "exp_avg")
        state[k] = st
    return {**state_dict, "state": state}


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
        state_dtype=None,
        stochastic_rounding=False,
        seed=0,
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
        if master_weights not in (True, False, "split"):
            raise ValueError(f"master_weights must be True, False or 'split', got {master_weights!r}")
        if not any(state_dtype is d or (isinstance(state_dtype, str) and state_dtype == d)
                   for d in (None, torch.float32, torch.bfloat16, "int8")):
            raise ValueError(f"state_dtype must be None, torch.float32, torch.bfloat16 or 'int8', got {state_dtype!r}")
        if stochastic_rounding and master_weights:
            raise ValueError("stochastic_rounding=True rounds params that have no master: "
                             "use it with master_weights=False")
        if not isinstance(seed, int) or not 0 <= seed < 1 << 63:
            raise ValueError(f"seed must be an int in [0, 2^63), got {seed!r}")
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
            seed=seed,  # the stochastic rounding's hash (saved with the groups)
        )
        super().__init__(params, defaults)
        self.master_weights = master_weights if master_weights == "split" else bool(master_weights)
        self.state_dtype = state_dtype
        self.stochastic_rounding = bool(stochastic_rounding)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.grad_norm = None
        self._hooks()
        self._advise()

    def _advise(self):
        """Says once what a new user would otherwise not learn: masters asked
        for with no 16-bit params, and float16 params without loss scaling."""
        dtypes = {p.dtype for g in self.param_groups for p in g["params"]}
        if self.master_weights == "split" and torch.float16 in dtypes:
            raise ValueError("master_weights='split' keeps bfloat16 params' masters as their low 16 bits; "
                             "float16 params need master_weights=True")
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
    _OWN = ("master_weights", "max_grad_norm", "grad_norm", "state_dtype", "stochastic_rounding")

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
            self.__dict__.setdefault(k, {"master_weights": False, "stochastic_rounding": False}.get(k))
        if not hooks:
            self._hooks()
        for g in self.param_groups:
            g.setdefault("amsgrad", False)
            g.setdefault("maximize", False)
            g.setdefault("decoupled_weight_decay", self._decoupled)
            g.setdefault("seed", 0)

    # torch's load_state_dict casts every state tensor to its param's dtype,
    # which would round masters and float32 moments to bf16: keep them.
    # References, not copies (a copy of every state tensor raised a resume's
    # peak by the whole optimizer state; torch's own load copies nothing
    # whose dtype already matches): only the float32 tensors torch would
    # cast, the loaded dict's own, as torch's load keeps them.
    @staticmethod
    def _keep_float32(opt, state_dict):
        # Keyed by the param's position among the groups' params, as torch's
        # load matches them: the saved keys are ints (``state_dict()``) or
        # whatever the saved groups list (torch.distributed.checkpoint's
        # ``set_optimizer_state_dict`` passes FQNs).
        order = {k: i for i, k in enumerate(k for g in state_dict["param_groups"] for k in g["params"])}
        opt._incoming = {
            order.get(k, k): {n: t for n, t in s.items()
                              if isinstance(t, torch.Tensor) and n != "step" and
                              t.dtype in (torch.float32, torch.bfloat16, torch.int16, torch.uint8)}
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
                if n in st and st[n].dtype != t.dtype:
                    st[n] = t.to(p.device)
        # Every state in this optimizer's formats, whatever it came from
        # (torch's AdamW casts a master it carried to the param's dtype, and
        # its own state has 16-bit moments): masters float32, split (the
        # param set to the master rounded, as the kernel keeps it) or none,
        # moments in the mode's dtype (a cast: the quantization of torch's
        # state is deterministic).
        keys = opt._keys() if opt.state_dtype == "int8" else {}
        seeds = {id(p): g.get("seed", 0) for g in opt.param_groups for p in g["params"]}
        for p, st in opt.state.items():
            opt._normalize(p, st, seeds.get(id(p), 0), keys.get(id(p), 0))
        opt._incoming = {}

    def _master_kind(self, p):
        if p.dtype == torch.bfloat16 and self.master_weights == "split":
            return "split"
        return "f32" if self.master_weights and p.dtype in _SIXTEEN else None

    def _moment_dtype(self, p):
        if self.state_dtype == "int8":
            real = p.dtype in KERNEL_DTYPES and not p.is_meta and not _local(p).is_meta
            if real and p.numel() >= Q8_MIN_NUMEL:
                return torch.uint8
            return torch.float32 if p.dtype in KERNEL_DTYPES else p.dtype
        if self.state_dtype is not None:
            return self.state_dtype
        return torch.float32 if self._master_kind(p) else p.dtype

    @torch.no_grad()
    def _convert_moments(self, p, st, seed, key):
        """The moments in this optimizer's format for ``p``: float moments
        quantized by the library (``quantize_moments``: a loaded torch state,
        or one of another ``state_dtype``), codes decoded (a state of
        ``state_dtype="int8"`` loaded into another format), else a cast."""
        want = self._moment_dtype(p)
        have = [n for n in _MOMENTS if isinstance(st.get(n), torch.Tensor)]
        for n in have:
            t, scale = st[n], st.get(_SCALE[n])
            if t.dtype == torch.uint8 and isinstance(scale, torch.Tensor) and not _sharded(p) and \
                    scale.numel() != q8_scales_len(t.shape) and want == torch.uint8:
                # Codes on the flat grid (saved before row lengths): decoded
                # there, quantized again on the rows' blocks below.
                st[n] = dequantize_moment(t, st.pop(_SCALE[n]), n == "exp_avg")
                continue
            if t.dtype == torch.uint8 and want != torch.uint8:
                scale = st.pop(_SCALE[n], None)
                st[n] = (torch.zeros_like(t, dtype=want) if scale is None else
                         dequantize_moment(t, scale, n == "exp_avg").to(want))
            elif t.dtype != torch.uint8 and t.dtype != want and want != torch.uint8:
                st[n] = t.to(want)
        if want == torch.uint8:
            floats = {n: st[n] for n in have if st[n].dtype != torch.uint8 or _SCALE[n] not in st}
            if floats:
                z = lambda t: t if t.dtype != torch.uint8 else torch.zeros_like(t, dtype=torch.float32)  # noqa: E731
                m = z(floats.get("exp_avg", torch.zeros_like(p, dtype=torch.float32)))
                v = z(floats.get("exp_avg_sq", torch.zeros_like(p, dtype=torch.float32)))
                x = z(floats["max_exp_avg_sq"]) if "max_exp_avg_sq" in floats else None
                # In the param's shape: its rows are the blocks' (q8_row).
                shape = _local(p).shape
                x = None if x is None else _local(x).reshape(shape)
                m, v = _local(m).reshape(shape), _local(v).reshape(shape)
                q = quantize_moments(m, v, x, seed=seed, step=float(st.get("step", 0)) or 1, key=key)
                for n in floats:
                    codes = q[n][0].view(_local(p).shape).to(_local(p).device)
                    st[n], st[_SCALE[n]] = _like(p, codes), _scales_like(p, q[n][1])
            layout = _scale_layout(p)
            for n in have:
                scale = st.get(_SCALE[n])
                if not isinstance(scale, torch.Tensor):
                    continue
                if layout is not None and layout[0] == "rows":
                    st[_SCALE[n]] = _rows_scales(p, scale, layout[1])
                elif layout is not None and not isinstance(scale, _DTENSOR):
                    # A sharded param's scales loaded as the rank's plain tensor.
                    st[_SCALE[n]] = _scales_like(p, scale)
                elif layout is None and scale.dim() != 1:
                    # A full state dict of a sharded run: its rows' scales, flat.
                    st[_SCALE[n]] = scale.reshape(-1)

    @torch.no_grad()
    def _normalize(self, p, st, seed=0, key=0):
        kind = self._master_kind(p)
        low = st.get("master_low")
        if low is not None and low.dtype != torch.int16:
            low = st.pop("master_low")  # torch's load cast it: its bits are gone
            low = None
        if kind == "split":
            if "master" in st:
                master = st.pop("master").float()
                hi, st["master_low"] = split_master(master)
                p.copy_(hi)
            elif low is None:
                st["master_low"] = torch.zeros_like(p, dtype=torch.int16)
        elif kind == "f32":
            if low is not None:
                st["master"] = join_master(p, st.pop("master_low"))
            elif "master" not in st:
                st["master"] = p.detach().float()
            elif st["master"].dtype != torch.float32:
                st["master"] = st["master"].float()
        self._convert_moments(p, st, seed, key)

    def _init_state(self, p, group):
        st = self.state[p]
        kind = self._master_kind(p)
        if st:
            # A state loaded (the load hook put it in this optimizer's
            # formats) or set by hand: the dtypes the step needs, no param
            # written here (a split master is made from a float32 one by the
            # load hook only).
            if kind == "f32" and "master" not in st:
                st["master"] = join_master(p, st.pop("master_low")) if "master_low" in st else p.detach().float()
            if kind == "f32" and st["master"].dtype != torch.float32:
                st["master"] = st["master"].float()
            if kind == "split" and ("master_low" not in st or st["master_low"].dtype != torch.int16):
                st["master_low"] = torch.zeros_like(p, dtype=torch.int16)
            self._convert_moments(p, st, group.get("seed", 0), getattr(self, "_key_of", {}).get(id(p), 0))
            if group["amsgrad"] and "max_exp_avg_sq" not in st:
                st["max_exp_avg_sq"] = torch.zeros_like(st["exp_avg_sq"])
                if "exp_avg_sq_scale" in st:
                    st["max_exp_avg_sq_scale"] = torch.zeros_like(st["exp_avg_sq_scale"])
            return st
        moment = self._moment_dtype(p)
        st["step"] = torch.tensor(0.0, dtype=torch.float32)
        st["exp_avg"] = torch.zeros_like(p, dtype=moment, memory_format=torch.preserve_format)
        st["exp_avg_sq"] = torch.zeros_like(p, dtype=moment, memory_format=torch.preserve_format)
        if group["amsgrad"]:
            st["max_exp_avg_sq"] = torch.zeros_like(p, dtype=moment, memory_format=torch.preserve_format)
        if moment == torch.uint8:  # codes 0 under scales 0: zero moments
            for n in _MOMENTS:
                if n in st:
                    st[_SCALE[n]] = _scales_like(p, torch.zeros(0))
        if kind == "f32":
            st["master"] = p.detach().float()
        elif kind == "split":
            st["master_low"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.preserve_format)
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
        sr = self.state_dtype == torch.bfloat16 or self.state_dtype == "int8" or self.stochastic_rounding
        self._key_of = self._keys() if sr else {}
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
            master = "split" if "master_low" in st else ("f32" if "master" in st else None)
            key = (real, st["exp_avg"].dtype, master, float(st["step"]) + 1)
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
        for (real, moment, master, step), items in buckets.items():
            if real == torch.float64 or real == "meta":
                self._run_float64(group, items, coef, decoupled)
                continue
            rounding = SR_MOMENTS if moment == torch.bfloat16 and self.state_dtype == torch.bfloat16 else 0
            if self.stochastic_rounding and master is None and real == torch.bfloat16:
                rounding |= SR_PARAMS
            q8 = moment == torch.uint8
            scales = lambda n: [_local_scales(p, s[_SCALE[n]]) for p, s in items] if q8 else []  # noqa: E731
            torch.ops.npukern.adamw_(
                [_flat(p) for p, _ in items],
                [_flat(p.grad) for p, _ in items],
                [_flat(s["exp_avg"]) for _, s in items],
                [_flat(s["exp_avg_sq"]) for _, s in items],
                [_flat(s["max_exp_avg_sq"]) for _, s in items] if group["amsgrad"] else [],
                [_flat(s["master"]) for _, s in items] if master == "f32" else
                [_flat(s["master_low"]) for _, s in items] if master == "split" else [],
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
                scales("exp_avg"),
                scales("exp_avg_sq"),
                scales("max_exp_avg_sq") if group["amsgrad"] else [],
                1 if master == "split" else 0,
                rounding,
                int(group.get("seed", 0)),
                [self._key_of[id(p)] for p, _ in items] if rounding or q8 else [],
                1 if q8 else 0,
                [q8_row(p) for p, _ in items] if q8 else [],
            )
            for _, st in items:
                st["step"] += 1

    def _keys(self):
        """Each param's stochastic-rounding key: the index of its element 0
        among every param's elements (the groups' order), so no two elements
        share random bits. A DTensor shard (FSDP2) adds its offset in the
        whole param: every cut of the model into ranks rounds alike."""
        keys, base = {}, 0
        for g in self.param_groups:
            for p in g["params"]:
                keys[id(p)] = base + _shard_offset(p)
                base += p.numel() * (2 if p.is_complex() else 1)
        return keys

    @staticmethod
    def _run_float64(group, items, coef, decoupled):
        """float64 (and complex128) params: torch's own single-tensor Adam (npukern's
        kernel is float32 inside), the clip applied to a scaled copy of each gradient.
        Meta params too (no elements: what torch's AdamW does with them), their
        masters stepped in the param's place and copied back."""
        from torch.optim.adam import adam

        b1, b2 = group["betas"]
        stepped = [s["master"] if "master" in s else p for p, s in items]
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


def _shard_offset(p):
    """The flat index of a DTensor's local element 0 in the whole tensor
    (0 for a plain tensor or a replica)."""
    if _DTENSOR is None or not isinstance(p, _DTENSOR) or not _sharded(p):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    stride, flat = 1, 0
    for d in reversed(range(len(p.shape))):
        flat += offset[d] * stride
        stride *= p.shape[d]
    return flat * (2 if p.is_complex() else 1)


def _like(p, local):
    """``local`` (the rank's elements, in its shard's shape) as a DTensor placed
    as ``p`` is, or itself when ``p`` is a plain tensor."""
    if _DTENSOR is None or not isinstance(p, _DTENSOR):
        return local
    return _DTENSOR.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def _scale_layout(p):
    """How a sharded param's 8-bit block scales are laid out as a DTensor
    (torch.distributed.checkpoint saves a plain tensor once, as a replica).
    A param of two or more dims sharded on dim 0 (FSDP2): its scales as
    ``[rows, ceil(row / 256)]``, a row of scales per row of the param, placed
    as the param is (``("rows", shape)``): each rank's scales are its rows',
    uneven cuts included, and the whole is the unsharded param's scales
    exactly (``q8_scales_len(shape)`` of them). Else ``("padded", placements,
    shards, padded)``: every rank holds ``padded`` scales (the blocks of the
    largest shard, torch.chunk's first; a smaller shard's unused ones stay
    0), ``Shard(0)`` over the mesh dim the param is sharded on, ``shards *
    padded`` in all. None for a plain or replicated param (plain scales) and
    for a param sharded over two mesh dims (plain scales:
    torch.distributed.checkpoint would keep one rank's)."""
    if not _sharded(p):
        return None
    shard = [(i, pl) for i, pl in enumerate(p.placements) if pl.is_shard()]
    if len(shard) != 1:
        return None
    i, pl = shard[0]
    from torch.distributed.tensor import Shard

    dim = pl.dim % p.dim()
    if dim == 0 and p.dim() >= 2 and p.shape[0] > 0:
        return "rows", (p.shape[0], -(-_row_len(p.shape) // Q8_BLOCK))
    shards, size = p.device_mesh.size(i), p.shape[dim]
    largest = list(p.shape)
    largest[dim] = min(-(-size // shards), size)
    placements = tuple(Shard(0) if pl.is_shard() else pl for pl in p.placements)
    return "padded", placements, shards, q8_scales_len(largest)


def _scales_like(p, local):
    """The rank's block scales ``local`` (at least its blocks; more are
    dropped, fewer padded with 0) as the state keeps them: a DTensor laid out
    by ``_scale_layout`` for a sharded param, else a plain tensor of
    ``q8_scales_len(shape)``."""
    lp = _local(p)
    local = _local(local).float().reshape(-1).to(lp.device)
    layout = _scale_layout(p)
    n = q8_scales_len(lp.shape) if layout is None or layout[0] == "rows" else layout[3]
    if local.numel() != n:
        local = torch.cat([local[:n], local.new_zeros(max(0, n - local.numel()))])
    if layout is None:
        return local
    if layout[0] == "rows":
        rows, per_row = layout[1]
        return _DTENSOR.from_local(local.view(lp.shape[0], per_row), p.device_mesh, p.placements, run_check=False,
                                   shape=(rows, per_row), stride=(per_row, 1))
    _, placements, shards, padded = layout
    return _DTENSOR.from_local(local, p.device_mesh, placements, run_check=False, shape=(shards * padded,),
                               stride=(1,))


def _rows_scales(p, scale, shape):
    """A dim-0-sharded param's loaded scales in its layout (``[rows, blocks
    a row]`` placed as the param): kept when they are; else the whole
    param's scales (a one-process state loaded into FSDP2, which torch's
    loader may cut as a flat tensor) gathered and the rank's rows taken, or
    the rank's own as a plain tensor."""
    rows, per_row = shape
    lp = _local(p)
    if isinstance(scale, _DTENSOR):
        if tuple(scale.shape) == (rows, per_row) and scale.placements == p.placements:
            return scale
        scale = scale.full_tensor()  # every rank loads every param: a collective in step
    flat = scale.reshape(-1)
    if flat.numel() == rows * per_row:  # the whole param's: the rank's rows (all of them unsharded)
        first = _shard_offset(p) // _row_len(p.shape)
        flat = flat[first * per_row:first * per_row + q8_scales_len(lp.shape)]
    return _scales_like(p, flat)


def _local_scales(p, scales):
    """The scales of the rank's own blocks, flat, as the kernel takes them (a
    DTensor's local scales, any padding dropped)."""
    if _DTENSOR is None or not isinstance(scales, _DTENSOR):
        return scales.reshape(-1)
    return scales.to_local().reshape(-1)[:q8_scales_len(_local(p).shape)]


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
