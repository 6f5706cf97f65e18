"""TRL's fused LM head on npukern's kernels.

TRL's trainers (SFT, DPO, GRPO, KTO, RLOO; ``trl.trainer.utils.add_fused_lm_head``,
TRL 1.x) replace a model's forward with their own: the backbone, then
per-token log-probabilities of the labels (and the entropy, whether the
label is the argmax) from ``ChunkedLogProbFunction``, chunk by chunk of
vocabulary, in torch ops on a CPU. That forward replaces
:func:`npukern_torch.hf.patch`'s loss route, and its head made the patched
step 4x slower (AMD Zen 5, Llama hidden 1024 x 2 layers, vocab 32 000, 512
tokens, bf16: forward + backward 1 697 ms against 416).

:func:`install` puts npukern's :class:`_LogProbs` in its place for the heads
of models :func:`npukern_torch.hf.patch` swapped the loss of (``register``):
each chunk of tokens' logits on npukern's matmul (or torch's, as the loss
route decides) in TRL's compute dtype (autocast's, else the hidden
states'), the log-probabilities from npukern's cross-entropy kernel
(``-(lse - z_label)``, float32 inside), the entropy, TRL's metrics
(``log sum p^2``, the mean logit: DPO's and KTO's) and the argmax from the
same logits; the backward recomputes each chunk's logits (as TRL's does)
and the kernel writes ``g (onehot - softmax)`` over them, rounded once,
for the two gradient products (an entropy gradient, which SFT does not
take, in float32 torch ops). One chunk on npukern's matmul keeps
``softmax - onehot`` from the forward instead, and an upstream gradient of
one value over the tokens it reaches (SFT's) scales the two products'
float32 sums: no second product for the logits. A sampling temperature, logit scale or
soft-cap (GRPO's and RLOO's ``temperature``; Gemma 2, Granite, Cohere)
turns each chunk's logits into TRL's in float32 first (``_Transform``),
and the kernel runs over those. Every other call (a bias, float16,
another device, another model's head) runs TRL's own.
"""

import importlib.abc
import importlib.util
import inspect
import sys
import weakref
from math import isfinite

import torch

from . import loss as _loss
from . import route as _route

ops = torch.ops.npukern

# id(weight) -> (weakref to it, hf.patch's matmul choice): the heads whose
# TRL calls npukern takes.
_HEADS = {}
# id(weight) -> whether its last backward's upstream gradient was one value
# over its tokens (absent: not known yet). Only a hint: whether the next
# forward keeps ``softmax - onehot`` for the backward (a per-token gradient,
# DPO's or GRPO's, leaves it unused).
_UNIFORM = {}
# What this module computes of TRL's optional outputs (all TRL 1.16 has).
_OUTPUTS = frozenset(("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))
# The parameters of the TRL function this module stands in for (trl 1.16's):
# another signature is another contract, and TRL's own keeps it.
_SIGNATURE = ("ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size",
              "final_logit_softcapping", "logit_scale", "outputs")
# Rows of logits widened to float32 at a time for the entropy.
_ENTROPY_ROWS = 32


def register(weight, matmul):
    """Marks ``weight`` (a patched model's LM head) as one whose TRL fused
    head npukern computes, with the loss route's ``matmul`` choice."""
    _HEADS[id(weight)] = (weakref.ref(weight), matmul)
    _UNIFORM.pop(id(weight), None)  # a hint left by a dead weight of the same id


def unregister(weight):
    """Undoes :func:`register` (``hf.unpatch``)."""
    _HEADS.pop(id(weight), None)
    _UNIFORM.pop(id(weight), None)


def is_fused_forward(forward):
    """Whether ``forward`` (a module's own, from its ``__dict__``) is the one
    ``trl.trainer.utils.add_fused_lm_head`` put there: a TRL trainer built
    on the model before ``hf.patch`` ran (``SFTTrainer(model="name")``
    builds the model itself, so its users patch ``trainer.model``), or a
    wrapper of it (accelerate's autocast under ``bf16=True``). Known by its
    code (``functools.wraps`` gave it the model's names)."""
    utils = sys.modules.get("trl.trainer.utils")
    if utils is None:
        return False
    for _ in range(8):  # down the __wrapped__ chain
        fn = getattr(forward, "__func__", forward)
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_name == "_fused_forward" and code.co_filename == utils.__file__:
            return True
        forward = getattr(fn, "__wrapped__", None)
        if forward is None:
            return False
    return False


def is_registered(weight):
    """Whether :func:`register` marked ``weight`` (and it is still alive)."""
    return _matmul_of(weight) is not None


def _matmul_of(weight):
    entry = _HEADS.get(id(weight))
    if entry is None or entry[0]() is not weight:
        return None
    return entry[1]


def install():
    """Puts npukern's log-probabilities in TRL's fused head: now if TRL's
    trainer utilities are imported, else as soon as they are (an import
    hook, when TRL is installed); a no-op when done already. Returns
    whether they are in place now."""
    utils = sys.modules.get("trl.trainer.utils")
    if utils is None:
        if importlib.util.find_spec("trl") is not None and not any(isinstance(f, _AfterImport)
                                                                    for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
        return False
    current = getattr(utils, "_ChunkedLogProbFunction", None)
    if current is None:
        return False
    if getattr(current, "_npukern", False):
        return True
    forward = getattr(current, "forward", None)
    if forward is None or tuple(inspect.signature(forward).parameters) != _SIGNATURE:
        return False
    utils._ChunkedLogProbFunction = type("ChunkedLogProbOnNpukern", (), {
        "_npukern": True,
        "original": current,
        "apply": staticmethod(lambda *a, **k: _apply(current, *a, **k)),
        "__doc__": "TRL's ChunkedLogProbFunction, on npukern's kernels where they take the call.",
    })
    return True


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs :func:`install` once ``trl.trainer.utils`` has been executed
    (TRL imported after ``hf.patch``), then leaves ``sys.meta_path``."""

    def find_spec(self, name, path, target=None):
        if name != "trl.trainer.utils":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            install()

        spec.loader.exec_module = exec_module
        return spec


def _compute_dtype(hidden):
    """TRL's: autocast's dtype where it is on, else the hidden states'."""
    return torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else hidden.dtype


def _takes(hidden, weight, bias, temperature, logit_scale, softcap, outputs):
    """Whether npukern computes this call (else TRL's own does)."""
    kernel = (torch.float32, torch.bfloat16)
    finite = all(isinstance(v, (int, float)) and isfinite(v) and v != 0
                 for v in (temperature, logit_scale) + (() if softcap is None else (softcap,)))
    return (_matmul_of(weight) is not None and bias is None and finite
            and set(("log_probs",) + tuple(outputs)) <= _OUTPUTS
            and hidden.device.type == "cpu" and weight.device.type == "cpu" and hidden.dim() == 2
            and hidden.dtype in kernel and weight.dtype in kernel and _compute_dtype(hidden) in kernel
            and not torch.compiler.is_compiling())


def _apply(original, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
           logit_scale=1.0, outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
    """TRL's ``ChunkedLogProbFunction.apply`` signature and result: the
    per-token log-probabilities, entropy, ``log(sum p^2)``, mean logit and
    top-1 flag (None where not requested)."""
    if not _takes(hidden, weight, bias, temperature, logit_scale, final_logit_softcapping, outputs):
        return original.apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                              logit_scale, outputs)
    want = tuple(k in outputs for k in ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"))
    plain = temperature == 1.0 and logit_scale == 1.0 and final_logit_softcapping is None
    transform = None if plain else _Transform(float(logit_scale), final_logit_softcapping, 1 / temperature)
    got = _LogProbs.apply(hidden, weight, targets, want, _matmul_of(weight), _compute_dtype(hidden), transform)
    return (got[0],) + tuple(g if w else None for g, w in zip(got[1:], want))


def _logits(xc, weight, npk, math):
    """One chunk's logits ``xc W^T``, rounded once to their dtype."""
    return ops.matmul(xc, weight, False, True, None, math) if npk else xc @ weight.t()


def _product(a, b, trans_a, out, npk, math):
    """``op(a) b`` in ``out``'s dtype: npukern's matmul rounds its float32
    sums once to it; torch's rounds to a's dtype first."""
    if npk:
        # npukern's matmul writes a's dtype or float32 (a bf16 weight's
        # gradient from float32 operands, TRL's cast_lm_head_to_fp32:
        # float32, then rounded once).
        c = ops.matmul(a, b, trans_a, False, None if out == a.dtype else torch.float32, math)
        return c if c.dtype == out else c.to(out)
    return ((a.t() if trans_a else a) @ b).to(out)


class _LogProbs(torch.autograd.Function):
    """Per-token ``log softmax(x W^T)[label]`` (float32) with, as ``want``
    says, the entropy of each row's distribution, ``log sum_v p_v^2``, the
    mean logit and whether the label is its first argmax, chunk by chunk of
    tokens (the ``[tokens, vocab]`` logits of a chunk at a time, as the
    fused loss's budget sets). Differentiable in ``x`` and ``W`` through the
    log-probabilities and the entropy (the others are TRL's metrics)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, want, matmul, dtype, transform):
        want_entropy, want_sq, want_mean, want_top1 = want
        ctx.set_materialize_grads(False)
        # In the compute dtype (autocast's, as TRL's head): the gradients
        # come back in the inputs' own.
        x, w = hidden.contiguous().to(dtype), weight.to(dtype)
        t = targets.reshape(-1).long().contiguous()
        n, vocab = x.shape[0], w.shape[0]
        if t.shape[0] != n:
            raise ValueError(f"npukern's TRL head: {t.shape[0]} labels for {n} rows")
        npk = _loss._npukern_head(x, w, None, matmul)
        math = _route.matmul_math(dtype)
        rows = _rows(n, vocab, x, math, transform)
        log_probs, lse = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.float32)
        entropy, sq, mean = (torch.empty(n if k else 0, dtype=torch.float32)
                             for k in (want_entropy, want_sq, want_mean))
        top1 = torch.empty(n, dtype=torch.bool) if want_top1 else torch.empty(0, dtype=torch.bool)
        # One chunk on npukern's matmul (whose products return float32 sums)
        # keeps ``p - onehot`` for the backward, which then needs no second
        # product for the logits when the upstream gradient is one value
        # over the tokens it reaches (SFT's ``-1 / tokens``).
        keep = (npk and rows >= n and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
                and _UNIFORM.get(id(weight), True))
        d = torch.empty(0, dtype=dtype)
        for start in range(0, n, rows):
            end = min(start + rows, n)
            logits = _logits(x[start:end], w, npk, math)
            chain = None
            if transform is not None:  # TRL's logits: scaled, capped, over the temperature (float32)
                logits, chain = transform.forward(logits, keep=True) if keep else (transform.forward(logits), None)
            loss, lse_c = ops.cross_entropy(logits, t[start:end], None, 0, -100, 0.0, 0.0, 0.0)
            torch.neg(loss, out=log_probs[start:end])
            lse[start:end] = lse_c
            if want_entropy or want_sq or want_mean:
                _row_stats(logits, lse_c, *(o[start:end] if o.numel() else None for o in (entropy, sq, mean)))
            if want_top1:
                _top1(logits, t[start:end], top1[start:end])
            if keep:  # p - onehot over the logits, rounded once (through the transform in float32)
                ops.cross_entropy_fused_(logits, t, None, torch.ones(n), -100, 0.0, 0.0, 0.0)
                d = logits if transform is None else transform.backward(logits, chain).to(dtype)
            del logits, chain
        ctx.save_for_backward(x, weight, t, lse, entropy, d)
        ctx.setup = (npk, math, rows, hidden.dtype, dtype, transform, id(weight))
        ctx.mark_non_differentiable(sq, mean, top1)
        return log_probs, entropy, sq, mean, top1

    @staticmethod
    def backward(ctx, g_log_probs, g_entropy, *_metrics):
        x, weight, t, lse, entropy, d = ctx.saved_tensors
        npk, math, rows, x_dtype, dtype, transform, key = ctx.setup
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 7
        if (g_log_probs is None and g_entropy is None) or not (want_x or want_w):
            return none
        w = weight.to(dtype)
        n = x.shape[0]
        g_lp = torch.zeros(n, dtype=torch.float32) if g_log_probs is None else g_log_probs.float().contiguous()
        factor = _uniform(g_lp) if g_entropy is None else None
        _UNIFORM[key] = factor is not None  # the next forward's hint
        if factor is not None and d.numel():
            return _from_kept(d, factor, g_lp != 0, x, w, weight.dtype, x_dtype, want_x, want_w, math) + none[2:]
        d_x = torch.empty(x.shape, dtype=x_dtype) if want_x else None
        # A 16-bit weight's gradient: float32 sums of the chunks, rounded
        # once; a float32 weight's: the sums themselves.
        blocks = _loss._vocab_blocks(w.shape[0])
        d_w, sums = None, [None] * len(blocks)
        for start in range(0, n, rows):
            end = min(start + rows, n)
            xc = x[start:end]
            logits = _logits(xc, w, npk, math)
            z, chain = (logits, None) if transform is None else transform.forward(logits, keep=True)
            if g_entropy is None:
                # d log_prob / dz = onehot - p: the kernel writes scale (p -
                # onehot) over the logits, rounded once, with scale = -g.
                ops.cross_entropy_fused_(z, t[start:end], None, torch.neg(g_lp[start:end]), -100,
                                         0.0, 0.0, 0.0)
            else:
                z = _with_entropy(z, t[start:end], lse[start:end], entropy[start:end],
                                  g_lp[start:end], g_entropy[start:end].float())
            # Through the transform in float32, rounded once to the logits' dtype.
            logits = z if transform is None else transform.backward(z, chain).to(logits.dtype)
            del z, chain
            if d_x is not None:
                d_x[start:end] = _product(logits, w, False, x_dtype, npk, math)
            if want_w and start == 0 and end == n:
                d_w = _product(logits, xc, True, weight.dtype, npk, math)
            elif want_w:
                _loss._add_weight_grad(sums, blocks, logits, xc, npk, math)
            del logits
        if want_w and d_w is None:
            d_w = _loss._rounded(sums, blocks, weight)
        return (d_x, d_w) + none[2:]


def _uniform(g):
    """``-c`` when the nonzero entries of ``g`` all equal ``c`` (0 when
    there are none), else None."""
    live = g[g != 0]
    if live.numel() == 0:
        return 0.0
    c = live[0]
    return -float(c) if bool((live == c).all()) else None


def _from_kept(d, factor, live, x, w, w_dtype, x_dtype, want_x, want_w, math):
    """Both gradients from the kept ``d = p - onehot`` (one chunk): ``factor``
    (``-c``) times npukern's float32 products, then rounded once; rows the
    upstream gradient does not reach (``~live``: masked tokens) give none."""
    dead = ~live.unsqueeze(1)
    d_x = d_w = None
    if want_x:
        d_x = ops.matmul(d, w, False, False, torch.float32, math).mul_(factor).masked_fill_(dead, 0).to(x_dtype)
    if want_w:
        xs = x.masked_fill(dead, 0) if bool(dead.any()) else x
        d_w = ops.matmul(d, xs, True, False, torch.float32, math).mul_(factor).to(w_dtype)
    return d_x, d_w


def _row_stats(logits, lse, entropy, sq, mean):
    """Per row (``p = exp(z - lse)``), into each output not None: the
    entropy ``lse - sum_v p_v z_v``, ``log sum_v p_v^2`` and the mean logit
    ``sum_v z_v / vocab``, in float32 blocks of rows through buffers made
    once (fresh temporaries the size of the logits cost more in page faults
    than in arithmetic)."""
    rows = min(_ENTROPY_ROWS, logits.shape[0])
    z = torch.empty(rows, logits.shape[1], dtype=torch.float32)
    e = torch.empty_like(z)
    for r in range(0, logits.shape[0], rows):
        k = min(rows, logits.shape[0] - r)
        zk, ek, m = z[:k], e[:k], lse[r:r + k].unsqueeze(1)
        zk.copy_(logits[r:r + k])
        if mean is not None:
            torch.div(zk.sum(1), logits.shape[1], out=mean[r:r + k])
        if sq is not None:
            torch.sub(zk, m, out=ek).mul_(2.0).exp_()
            torch.log(ek.sum(1), out=sq[r:r + k])
        if entropy is not None:
            torch.sub(zk, m, out=ek).exp_().mul_(zk)
            torch.sub(lse[r:r + k], ek.sum(1), out=entropy[r:r + k])


def _top1(logits, t, out):
    """Whether each row's label is its first largest logit (torch's argmax,
    TRL's rule), without argmax's pass over 16-bit logits (scalar: 20x a
    max): the rows whose label's logit is the maximum, then for those an
    earlier equal maximum ruled out."""
    top = logits.amax(1)
    torch.eq(logits.gather(1, t.unsqueeze(1)).squeeze(1), top, out=out)
    for r in out.nonzero().flatten().tolist():
        if bool((logits[r, :t[r]] == top[r]).any()):
            out[r] = False


def _rows(n, vocab, x, math, transform=None):
    """Tokens per chunk: the fused loss's budget for the logits (and their
    float32 transform beside them, and its tanh under a cap), an even count
    under the bf16 pair dot when there are several chunks (the weight
    gradient's pairs of tokens must not depend on the cut)."""
    size = x.element_size() + (0 if transform is None else 4 if transform.cap is None else 8)
    return _loss._pair_rows(_loss._chunk_rows(n, vocab, x.shape[1], size, None, True), n, math)


class _Transform:
    """TRL's logits from the head's product ``y`` (``_torch_transform``): ``z
    = y s``, soft-capped ``c tanh(z / c)`` when there is a cap, times ``1 /
    T``, in float32 (Gemma 2's cap, Granite's and Cohere's scales, GRPO's
    and RLOO's sampling temperature). Its backward is TRL's too: ``dz``
    times ``1 / T``, times ``1 - tanh^2`` under a cap, times ``s``."""

    def __init__(self, scale, cap, inv_t):
        self.scale, self.cap, self.inv_t = scale, cap, inv_t

    def forward(self, y, keep=False):
        """``z`` in float32 (over ``y`` itself when it is float32; with
        ``keep``, and the tanh the backward needs, or None)."""
        z = y.float().mul_(self.scale)
        th = None
        if self.cap is not None:
            th = z.div_(self.cap).tanh_()
            z = th.mul(self.cap) if keep else th.mul_(self.cap)
        z.mul_(self.inv_t)
        return (z, th) if keep else z

    def backward(self, dz, th):
        """``dy`` from ``dz`` (float32, in place) and :meth:`forward`'s tanh."""
        dz.mul_(self.inv_t)
        if th is not None:
            dz.mul_(th.mul_(th).neg_().add_(1.0))
        return dz.mul_(self.scale)


def _with_entropy(logits, t, lse, entropy, g_lp, g_ent):
    """The chunk's dlogits when the entropy has a gradient too, in float32
    and rounded once: ``g_lp (onehot - p) - g_ent p (z - sum_v p_v z_v)``."""
    z = logits.float()
    p = torch.exp(z - lse.unsqueeze(1))
    mean_z = (lse - entropy).unsqueeze(1)  # sum_v p_v z_v
    d = -p * (g_lp.unsqueeze(1) + g_ent.unsqueeze(1) * (z - mean_z))
    d.scatter_add_(1, t.unsqueeze(1), g_lp.unsqueeze(1))
    return d.to(logits.dtype)
