"""The loss on npukern: ``cross_entropy`` (F.cross_entropy's signature and
result dtype, plus z-loss and logit soft-capping) and
``linear_cross_entropy`` (the LM head fused with the loss: chunks of
tokens, torch's matmul for each chunk's logits, npukern's kernel turning
them into the loss and their gradient in place -- the ``[N, V]`` logits
never exist).

Numerics: the kernel reads the logits in their dtype, computes in float32
(one pass over memory per row: the max, then from cache the sum of
exp(x - max) in a fixed order; exp and log of its own, the same bits on
every ISA; the fused form reuses those exps for the gradient), and
writes each gradient element with one rounding."""

import torch

from . import route as _route
from ._dtypes import KERNEL_DTYPES, on_kernels

ops = torch.ops.npukern

_REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}
#: The default memory budget for one chunk of logits in
#: :func:`linear_cross_entropy` (bytes).
CHUNK_BYTES = 128 << 20
# Vocabulary rows per float32 block of the weight gradient (several chunks).
_VOCAB_BLOCK = 8192
# Vocabulary rows of a chunk's gradient upcast to float32 at a time (several
# chunks): the copy is rows x 2048 floats, not the chunk's twice.
_UPCAST_ROWS = 2048


def _reduction(reduction):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {tuple(_REDUCTIONS)}, got {reduction!r}")
    return _REDUCTIONS[reduction]


def _softcap(softcap):
    if softcap is None:
        return 0.0
    if not softcap > 0:
        raise ValueError(f"softcap must be positive (or None), got {softcap}")
    return float(softcap)


_TYPE_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16"}


def _autocast_on(input):
    """Whether autocast runs ``F.cross_entropy`` on ``input`` in float32 (its
    fp32 policy: 16-bit and float32 inputs computed and returned in float32)."""
    return (input.is_floating_point() and input.dtype != torch.float64
            and torch.is_autocast_enabled(input.device.type))


def _check_weight_dtype(input, weight, autocast):
    """torch's rule: the class weight has the input's dtype (under autocast
    both are float32 after its casts, which leave a float64 weight alone).
    One extension: 16-bit logits take a float32 weight (the kernel reads
    weights in float32; nothing is rounded away)."""
    if weight is None:
        return
    want = torch.float32 if autocast else input.dtype
    got = weight.dtype
    if autocast and got in (torch.float16, torch.bfloat16):
        got = torch.float32
    if got == torch.float32 and want in (torch.float16, torch.bfloat16):
        return
    if got != want:
        raise RuntimeError(f"expected scalar type {_TYPE_NAMES.get(want, want)} but found "
                           f"{_TYPE_NAMES.get(got, got)}")


def _composite(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, softcap):
    """The same loss as torch ops (for what the kernel does not take)."""
    x = input.float() if input.dtype in KERNEL_DTYPES else input
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    loss = torch.nn.functional.cross_entropy(x, target, weight=weight, ignore_index=ignore_index,
                                             reduction=reduction, label_smoothing=label_smoothing)
    if z_loss:
        lse = torch.logsumexp(x, 1 if x.dim() > 1 else 0)
        keep = (target != ignore_index).to(lse.dtype)
        z = z_loss * lse.square() * keep
        if reduction == "mean":
            # Part of each row's loss, so divided by the loss's own denominator:
            # the weight sum over rows not ignored (docs/operators.md), as the kernel.
            if weight is None:
                den = keep.sum()
            else:
                classes = x.shape[1 if x.dim() > 1 else 0]
                den = (weight.to(lse.dtype)[target.clamp(0, classes - 1)] * keep).sum()
            z = z.sum() / den
        elif reduction == "sum":
            z = z.sum()
        loss = loss + z
    return loss.to(torch.float32 if _autocast_on(input) else input.dtype)


_NARROW_INDICES = (torch.uint8, torch.int8, torch.int16)


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, *,
                  z_loss=0.0, softcap=None):
    """``torch.nn.functional.cross_entropy`` on npukern: ``input`` ``(C)``,
    ``(N, C)`` or ``(N, C, d1, ...)`` logits, class-index ``target``, the
    same ``weight``, ``ignore_index``, ``reduction`` (mean: the weighted mean
    over rows not ignored; NaN when every row is ignored) and
    ``label_smoothing``, and the result in input's dtype. ``z_loss`` adds
    ``z_loss * lse**2`` per row not ignored, part of that row's loss (so a
    mean divides it by the same weighted denominator); ``softcap`` replaces
    the logits by ``softcap * tanh(logits / softcap)`` first (Gemma2). Differentiable in input.
    Class-probability targets, float64 and non-CPU inputs run torch's own."""
    red = _reduction(reduction)
    cap = _softcap(softcap)
    if not on_kernels(input) or target.dtype.is_floating_point or input.dim() == 0:
        return _composite(input, target, weight, ignore_index, reduction, label_smoothing, z_loss, cap)
    # Under autocast the result is float32, as F.cross_entropy's (the
    # kernel reads the 16-bit logits as they are: float32 inside either way).
    autocast = _autocast_on(input)
    _check_weight_dtype(input, weight, autocast)
    x, t = input, target
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        # As torch's nll_loss: the loss is not differentiable in the class weight.
        raise RuntimeError("cross_entropy: the loss is not differentiable with respect to 'weight' "
                           "(it requires grad); pass weight.detach()")
    if x.dim() > 2 and tuple(t.shape) != (x.shape[0],) + tuple(x.shape[2:]):
        # (N, C, d1, ...) pairs with an (N, d1, ...) target, as torch checks.
        raise ValueError(f"cross_entropy: expected target of shape {[x.shape[0]] + list(x.shape[2:])} "
                         f"for input of shape {list(x.shape)}, got {list(t.shape)}")
    if x.dim() == 1:  # unbatched (C)
        x, t = x.unsqueeze(0), t.unsqueeze(0)
    elif x.dim() > 2:  # (N, C, d1, ...): classes last
        x, t = x.movedim(1, -1).reshape(-1, x.shape[1]), t.reshape(-1)
    if t.dtype in _NARROW_INDICES:  # torch takes them too; the kernel reads int32/int64
        t = t.long()
    if weight is not None and weight.dtype != torch.float32:
        weight = weight.float()
    loss, _lse = ops.cross_entropy(x.contiguous(), t.contiguous(), weight, red, ignore_index,
                                   float(label_smoothing), float(z_loss), cap)
    if red == 0:
        loss = loss.reshape(target.shape)
    return loss if autocast else loss.to(input.dtype)


def _lce_grads(x, weight, t, bias, ignore_index, red, label_smoothing, z_loss, softcap, chunk_bytes, matmul, want):
    """The loss (0-dim float32) and its gradients in input, weight and bias
    (each None unless ``want`` says so), chunk by chunk."""
    want_input, want_weight, want_bias = want
    n, vocab = x.shape[0], weight.shape[0]
    # The crate's own factor and reduction (one definition, loss_ops.cpp).
    grad_scale = ops.cross_entropy_grad_scale(t, None, red, ignore_index, 1.0)
    d_input = torch.empty_like(x) if want_input else None
    acc = torch.float32  # 16-bit weights get float32 gradients, rounded once at the end
    d_bias = torch.zeros(vocab, dtype=acc) if bias is not None and want_bias else None
    rows = _chunk_rows(n, vocab, x.shape[1], x.element_size(), chunk_bytes, want_weight)
    # One chunk: the weight gradient is one matmul, stock's bits. Several:
    # float32 sums per block of vocabulary rows, each chunk's part a
    # float32 matmul of upcast copies added in (torch has no CPU matmul
    # of 16-bit inputs with a float32 result; rounding each part to
    # 16 bits cost accuracy); the blocks are freed one by one as the
    # result is rounded (peak: the float32 sums, not them and the result).
    blocks = _vocab_blocks(vocab)
    sums = [None] * len(blocks)
    d_weight = None
    losses = torch.empty(n, dtype=torch.float32)
    if _npukern_head(x, weight, bias, matmul):
        return _lce_grads_npukern(x, weight, t, ignore_index, red, label_smoothing, z_loss, softcap, rows, want,
                                  grad_scale, losses)
    for start in range(0, n, rows):
        xc = x[start:start + rows]
        logits = xc @ weight.t() if bias is None else torch.addmm(bias, xc, weight.t())
        loss, _lse = ops.cross_entropy_fused_(logits, t[start:start + rows], None, grad_scale, ignore_index,
                                              float(label_smoothing), float(z_loss), softcap)
        losses[start:start + rows] = loss
        # The logits now hold dloss/dlogits (times grad_scale).
        if d_input is not None:
            torch.mm(logits, weight, out=d_input[start:start + rows])
        if want_weight and rows >= n:
            d_weight = torch.mm(logits.t(), xc)
        elif want_weight:
            _add_weight_grad(sums, blocks, logits, xc, False, None)
        if d_bias is not None:
            d_bias += logits.sum(0, dtype=acc)
        del logits
    if want_weight and d_weight is None:
        d_weight = _rounded(sums, blocks, weight)
    total = ops.cross_entropy_reduce(losses, t, None, red, ignore_index)
    if d_bias is not None:
        d_bias = d_bias.to(bias.dtype)
    return total, d_input, d_weight, d_bias


def _chunk_rows(n, vocab, hidden, itemsize, chunk_bytes, want_weight):
    """Tokens per chunk: as many as ``chunk_bytes`` of logits hold, or (the
    default budget, ``chunk_bytes`` None) all ``n`` when one chunk's peak
    -- all the logits and the weight gradient written beside them -- is no
    higher than several chunks' -- a chunk's logits and the weight
    gradient's float32 sums: ``(n - rows) itemsize <= hidden (4 -
    itemsize)``, up to ``hidden`` tokens past the budget for 16-bit logits,
    never for float32. The same bits on npukern's matmul (the same chain,
    rounded once). A Qwen2.5-1.5B head of 151 936 x 1536 over 512 tokens:
    156 + 467 MB against 134 + 934 MB."""
    budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows = max(1, min(n, budget // max(1, vocab * itemsize)))
    one, several = (n * vocab + vocab * hidden) * itemsize, rows * vocab * itemsize + vocab * hidden * 4
    if chunk_bytes is None and want_weight and rows < n and one <= several:
        return n
    return rows


def _vocab_blocks(vocab):
    """The weight gradient's float32 blocks of vocabulary rows."""
    return [(j, min(j + _VOCAB_BLOCK, vocab)) for j in range(0, vocab, _VOCAB_BLOCK)]


def _pair_rows(rows, n, math):
    """``rows`` per chunk, made even (a one-row budget two) under the bf16
    pair dot when there are several chunks: the weight gradient sums its
    tokens two at a time, so an odd chunk would pair a token with the next
    chunk's and the bits would depend on the chunking."""
    if math != _route.CHAIN and rows < n and rows % 2:
        return max(2, rows - 1)
    return rows


def _add_weight_grad(sums, blocks, dlogits, xc, npk, math):
    """Adds a chunk's ``dlogits^T xc`` into the weight gradient's float32
    sums of each block of vocabulary rows (``sums[b]`` None: the chunk
    writes it). On npukern's matmul (``npk``) the kernel accumulates into
    them itself, k ascending; on torch's, each part is upcast to float32
    ``_UPCAST_ROWS`` vocabulary rows at a time and added by addmm: a part
    rounded to the weight's dtype first (a bf16 mm) added a rounding per
    chunk, 1.3-1.7x stock's error against float64."""
    if npk:
        for b, (j0, j1) in enumerate(blocks):
            if sums[b] is None:
                sums[b] = ops.matmul(dlogits[:, j0:j1], xc, True, False, torch.float32, math)
            else:
                ops.matmul_accumulate_(sums[b], dlogits[:, j0:j1], xc, True, False, math)
        return
    xf = xc.to(torch.float32)
    for b, (j0, j1) in enumerate(blocks):
        first = sums[b] is None
        if first:
            sums[b] = torch.empty(j1 - j0, xc.shape[1], dtype=torch.float32)
        for k0 in range(j0, j1, _UPCAST_ROWS):
            k1 = min(k0 + _UPCAST_ROWS, j1)
            part, into = dlogits[:, k0:k1].t().to(torch.float32), sums[b][k0 - j0:k1 - j0]
            if first:
                torch.mm(part, xf, out=into)
            else:
                into.addmm_(part, xf)


def _rounded(sums, blocks, weight):
    """The weight gradient in the weight's dtype from the float32 ``sums``
    of each of ``blocks`` (None: no rows reached it, zeros, as torch's), each
    block's sums freed as it is rounded (peak: the float32 sums, not them and
    the result)."""
    d_weight = torch.empty(weight.shape, dtype=weight.dtype)
    for b, (j0, j1) in enumerate(blocks):
        if sums[b] is None:
            d_weight[j0:j1].zero_()
        else:
            d_weight[j0:j1].copy_(sums[b])
        sums[b] = None
    return d_weight


def _npukern_head(x, weight, bias, matmul):
    """Whether the head's three products run on npukern's matmul: ``matmul``
    is "npukern", or "auto" where :func:`npukern_torch.route.matmul_route`
    takes the dtype on this CPU (a head without bias, one dtype)."""
    if matmul == "torch" or bias is not None or x.dtype != weight.dtype or torch.compiler.is_compiling():
        return False
    return matmul == "npukern" or _route.matmul_route(x.dtype)


def _lce_grads_npukern(x, weight, t, ignore_index, red, label_smoothing, z_loss, softcap, rows, want, grad_scale,
                       losses):
    """:func:`_lce_grads` on npukern's matmul: each chunk's logits ``x W^T``
    rounded once, its input gradient ``dlogits W``, and the weight gradient's
    float32 sums accumulated by the kernel itself (``dlogits^T x`` added into
    them, chunk after chunk, k ascending), rounded once at the end, in blocks
    of vocabulary rows (each block's sums freed as it is rounded). The
    first chunk writes the sums (no zeroed buffer first), and one chunk alone
    writes the gradient in the weight's dtype directly: the same chain and
    one rounding, without a vocab x hidden float32 buffer (its zeroing, a
    second pass over it, and the cast were 40% of the head's weight
    gradient).

    The products are summed as :func:`npukern_torch.route.matmul_math` says
    for the dtype: the bf16 pair dot (on AMD Zen 4 and later) sums the
    weight gradient's tokens two at a time, so every chunk but the last has
    an even number of rows there (an odd chunk would pair a token with the
    next chunk's differently, and the bits would depend on the chunking);
    the budget's odd row count is rounded down (a one-row budget up to
    two)."""
    want_input, want_weight, _ = want
    n = x.shape[0]
    math = _route.matmul_math(x.dtype)
    rows = _pair_rows(rows, n, math)
    d_input = torch.empty_like(x) if want_input else None
    blocks = _vocab_blocks(weight.shape[0])
    d_weight, sums = None, [None] * len(blocks)
    for start in range(0, n, rows):
        xc = x[start:start + rows]
        logits = ops.matmul(xc, weight, False, True, None, math)
        loss, _lse = ops.cross_entropy_fused_(logits, t[start:start + rows], None, grad_scale, ignore_index,
                                              float(label_smoothing), float(z_loss), softcap)
        losses[start:start + rows] = loss
        if d_input is not None:
            d_input[start:start + rows] = ops.matmul(logits, weight, False, False, None, math)
        if want_weight and start == 0 and start + rows >= n:
            d_weight = ops.matmul(logits, xc, True, False, None, math)  # one chunk: the dtype directly
        elif want_weight:
            _add_weight_grad(sums, blocks, logits, xc, True, math)
        del logits
    if want_weight and d_weight is None:
        # Block by block (one vocab x hidden float32 buffer rounded at once
        # held it and the result together: +0.47 GB at 151 936 x 1536).
        d_weight = _rounded(sums, blocks, weight)
    total = ops.cross_entropy_reduce(losses, t, None, red, ignore_index)
    return total, d_input, d_weight, None


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and every gradient chunk by chunk (the
    logits of a chunk turned into their gradient in place by the kernel);
    backward scales the saved gradients by the upstream one. Reductions
    "sum" (red 1) and "mean" (red 2) only.

    ``loss.backward()`` hands the saved gradients out as they are (no second
    copy of the weight gradient): they become ``.grad``, which the caller may
    then change (``zero_()``, an optimizer). So any later backward of the
    same graph (``retain_graph=True``) recomputes them from the saved inputs,
    as stock autograd's would be computed again. Differentiable once: a
    second derivative raises."""

    @staticmethod
    def forward(ctx, input, weight, target, bias, ignore_index, red, label_smoothing, z_loss, softcap,
                chunk_bytes, matmul):
        hidden = input.shape[-1]
        x = input.reshape(-1, hidden)
        t = target.reshape(-1)
        if t.shape[0] != x.shape[0]:
            raise ValueError(f"linear_cross_entropy: target has {t.shape[0]} rows, input {x.shape[0]}")
        ctx.args = (ignore_index, red, label_smoothing, z_loss, softcap, chunk_bytes, matmul)
        ctx.want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
        total, d_input, d_weight, d_bias = _lce_grads(x, weight, t, bias, *ctx.args, want=ctx.want)
        ctx.shape = input.shape
        # Kept as attributes, not saved tensors: once handed out as .grad they
        # may be changed, and a later backward recomputes instead.
        ctx.grads = (d_input, d_weight, d_bias)
        ctx.save_for_backward(input, weight, target, bias)
        return total

    @staticmethod
    def backward(ctx, grad):
        grads = _LinearCrossEntropy._grads(ctx, grad)
        return _once_differentiable(grads, "linear_cross_entropy")

    @staticmethod
    def _grads(ctx, grad):
        if ctx.grads is None:
            # A later backward of a retained graph: the first one handed the
            # gradients out; computed again (torch's own in-place checks on
            # the saved inputs apply).
            input, weight, target, bias = ctx.saved_tensors
            _, d_input, d_weight, d_bias = _lce_grads(input.reshape(-1, input.shape[-1]), weight,
                                                      target.reshape(-1), bias, *ctx.args, want=ctx.want)
        else:
            d_input, d_weight, d_bias = ctx.grads
        g = grad.reshape(())
        # Under torch.compile the scale is always applied (no data-dependent branch).
        if not torch.compiler.is_compiling() and g.item() == 1.0:
            # loss.backward(): the gradients as they are (no second copy of d_weight).
            ctx.grads = None
            di = d_input.reshape(ctx.shape) if d_input is not None else None
            return di, d_weight, None, d_bias, None, None, None, None, None, None, None
        di = (d_input * g.to(d_input.dtype)).reshape(ctx.shape) if d_input is not None else None
        dw = d_weight * g.to(d_weight.dtype) if d_weight is not None else None
        db = d_bias * g.to(d_bias.dtype) if d_bias is not None else None
        return di, dw, None, db, None, None, None, None, None, None, None


def _once_differentiable(grads, op):
    """``grads`` as ``torch.autograd.function.once_differentiable`` returns a
    backward's results under ``create_graph=True``: differentiating them
    again raises instead of seeing zero. (Outside create_graph, and under
    torch.compile, which traces the plain backward, they pass as they are.)"""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return grads
    msg = (f"npukern_torch.{op} is differentiable once: its gradient has no derivative "
           "(use torch.nn.functional.cross_entropy for a second derivative)").encode()
    out = []
    for g in grads:
        if g is None:
            out.append(None)
            continue
        alias = g.detach()
        alias.requires_grad_(True)
        out.append(torch._C._functions.DelayedError(msg, 1)(alias))
    return tuple(out)


def linear_cross_entropy(input, weight, target, bias=None, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, *, z_loss=0.0, softcap=None, chunk_bytes=None, matmul="torch"):
    """``cross_entropy(input @ weight.T + bias, target, ...)`` without the
    ``[N, V]`` logits: chunks of tokens whose logits (in input's dtype,
    ``chunk_bytes`` of them at most; by default :data:`CHUNK_BYTES`, or all
    tokens in one chunk where that holds less memory than chunking with its
    weight gradient's float32 sums) come from
    torch's matmul and are turned into their gradient in place by npukern's
    kernel; the input and weight (and bias) gradients are accumulated chunk
    by chunk (float32 for 16-bit weights, rounded once). Returns the float32
    loss (what Hugging Face's loss returns). Tied weights work (the
    gradient adds to the embedding's). ``matmul="npukern"`` runs the three
    products (logits, input gradient, the weight gradient's float32 sums) on
    npukern's matmul instead (a head without bias), ``"auto"`` where
    :func:`npukern_torch.route.matmul_route` takes the dtype on this CPU
    (what ``hf.patch`` passes); ``"torch"``, the default, keeps torch's.
    On npukern they are summed as :func:`npukern_torch.route.matmul_math`
    says (the bf16 pair dot on AMD Zen 4 and later, with even chunks)."""
    if matmul not in ("torch", "npukern", "auto"):
        raise ValueError(f"linear_cross_entropy: matmul must be 'torch', 'npukern' or 'auto', not {matmul!r}")
    red = _reduction(reduction)
    if red == 0:
        raise ValueError("linear_cross_entropy: reduction='none' is not supported (use 'sum' or 'mean')")
    cap = _softcap(softcap)
    dev = input.device.type
    if torch.is_autocast_enabled(dev) and on_kernels(input, weight):
        # Autocast: the logits as autocast's linear computes them (input,
        # weight and bias cast to its dtype, one matmul in it), chunk by
        # chunk through the kernel -- never the [N, V] logits; the casts'
        # own backward returns the gradients in the params' dtypes, as
        # under stock autocast.
        dt = torch.get_autocast_dtype(dev)
        if dt in (torch.bfloat16, torch.float16) and (bias is None or on_kernels(bias)):
            with torch.autocast(dev, enabled=False):
                return linear_cross_entropy(input.to(dt), weight.to(dt), target,
                                            None if bias is None else bias.to(dt), ignore_index, reduction,
                                            label_smoothing, z_loss=z_loss, softcap=softcap,
                                            chunk_bytes=chunk_bytes, matmul=matmul)
    if (not on_kernels(input, weight) or input.dtype != weight.dtype
            or (bias is not None and bias.dtype != weight.dtype) or torch.is_autocast_enabled(dev)):
        # What the kernel does not take (float64, other devices, mixed dtypes,
        # autocast's own casts) runs Hugging Face's composite: the logits in
        # torch's dtype, soft-capped there, then the loss of their float32 copy.
        logits = torch.nn.functional.linear(input.reshape(-1, input.shape[-1]), weight, bias)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return _composite(logits.float(), target.reshape(-1), None, ignore_index, reduction, label_smoothing, z_loss,
                          0.0)
    return _LinearCrossEntropy.apply(input, weight, target, bias, ignore_index, red, label_smoothing, z_loss,
                                     cap, chunk_bytes or None, matmul)

