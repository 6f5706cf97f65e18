"""Functional forms of the ops, shaped like torch_npu's (npu_rms_norm,
npu_add_rms_norm): they return rstd (and x_sum) besides y (add_rms_norm_
writes x_sum over x1 instead). Each is differentiable in x (x1, x2) and
gamma. ``casting`` and ``offset`` choose a model family's numerics (see
``_casting.py``)."""

import contextlib

import torch

from . import _casting
from . import route as _route
from ._composite import rotate_half
from ._fast import eager, is_compiling

ops = torch.ops.npukern
# The overloads, called eagerly without the torch.ops door (_fast.py).
_rms_norm_op = eager(ops.rms_norm.default)
_add_rms_norm_op = eager(ops.add_rms_norm.default)
_add_rms_norm_inplace_op = eager(ops.add_rms_norm_.default)
_embedding_op = eager(ops.embedding.default)
_swiglu_op = eager(ops.swiglu.default)
_silu_mul_op = eager(ops.silu_mul.default)
_geglu_op = eager(ops.geglu.default)
_gelu_mul_op = eager(ops.gelu_mul.default)
_rotary_mul_op = eager(ops.rotary_mul.default)
_rope_qk_op = eager(ops.rope_qk.default)
_NULL = contextlib.nullcontext()
_linear_op = eager(ops.linear.default)
_matmul_op = eager(ops.matmul.default)
_attention_op = eager(ops.attention.default)
# The decode-sized norms' C callers themselves, for the default numerics:
# one Python frame less per call (0.1 us of a 1x4096 call). None with the
# fast caller off.
_rms_norm_fast = getattr(_rms_norm_op, "fast", None)
_add_rms_norm_fast = getattr(_add_rms_norm_op, "fast", None)


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, *, casting: str = "torch", offset=None):
    """``(y, rstd)``: ``y = x / sqrt(mean(x**2) + eps) * (offset + gamma)`` over
    the trailing dims gamma covers, rounded as `casting` says ("torch": once;
    "llama": the normalized x to x's dtype first, then the product with
    torch's type promotion; "gemma": once, offset 1). rstd (float32) has x's
    shape with those dims set to 1. gamma is x's dtype or float32 (or, with
    "llama", any dtype torch promotes with x)."""
    if casting == "torch" and offset is None:  # the default numerics: the op itself, one Python frame less
        if _rms_norm_fast is not None and not is_compiling():
            return _rms_norm_fast(x, gamma, eps, 0.0, False)
        return _rms_norm_op(x, gamma, eps, 0.0, False)
    offset, cast_before_gamma = _casting.resolve(casting, offset)
    return _rms_norm(x, gamma, eps, offset, cast_before_gamma)


def _rms_norm(x, gamma, eps, offset, cast_before_gamma):
    """:func:`rms_norm` with `casting` resolved (the modules' entry)."""
    if cast_before_gamma and torch.promote_types(x.dtype, gamma.dtype) != x.dtype:  # _casting.needs_promotion
        normalized, rstd = _rms_norm_op(x, torch.ones_like(gamma, dtype=x.dtype), eps)
        return normalized * (gamma + offset if offset else gamma), rstd
    return _rms_norm_op(x, gamma, eps, offset, cast_before_gamma)


def add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, *,
                 casting: str = "torch", offset=None):
    """``(y, rstd, x_sum)``: ``x_sum = x1 + x2`` (rounded to x's dtype) and the
    RMSNorm of x_sum in `casting`'s numerics, in one pass (the residual add
    before a LLaMA block's norm)."""
    if casting == "torch" and offset is None:
        if _add_rms_norm_fast is not None and not is_compiling():
            return _add_rms_norm_fast(x1, x2, gamma, eps, 0.0, False)
        return _add_rms_norm_op(x1, x2, gamma, eps, 0.0, False)
    offset, cast_before_gamma = _casting.resolve(casting, offset)
    return _add_rms_norm(x1, x2, gamma, eps, offset, cast_before_gamma)


def _add_rms_norm(x1, x2, gamma, eps, offset, cast_before_gamma, op=_add_rms_norm_op):
    """:func:`add_rms_norm` (or, with the in-place `op`, :func:`add_rms_norm_`)
    with `casting` resolved (the modules' entry)."""
    if cast_before_gamma and torch.promote_types(x1.dtype, gamma.dtype) != x1.dtype:  # _casting.needs_promotion
        normalized, *rest = op(x1, x2, torch.ones_like(gamma, dtype=x1.dtype), eps)
        return normalized * (gamma + offset if offset else gamma), *rest
    return op(x1, x2, gamma, eps, offset, cast_before_gamma)


def add_rms_norm_(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, eps: float = 1e-6, *,
                  casting: str = "torch", offset=None):
    """``(y, rstd)``, with ``x1 + x2`` (rounded to x1's dtype) written over x1:
    Intel Extension for PyTorch's ``add_rms_norm(residual, x, weight, None,
    eps, add_back=True)`` as ``add_rms_norm_(residual, x, weight, eps)``. The
    bits are :func:`add_rms_norm`'s (x1 ends up holding its x_sum), without
    allocating x_sum. x1 must be contiguous, x2's dtype, and share no memory
    with x2 or gamma (ValueError / TypeError, x1 untouched). Differentiable
    like any in-place torch op (x1 not a leaf that requires grad)."""
    offset, cast_before_gamma = _casting.resolve(casting, offset)
    return _add_rms_norm(x1, x2, gamma, eps, offset, cast_before_gamma, _add_rms_norm_inplace_op)


def embedding(indices: torch.Tensor, weight: torch.Tensor, padding_idx=None, scale_grad_by_freq: bool = False):
    """``torch.nn.functional.embedding`` (without max_norm and sparse) whose
    weight gradient comes from npukern's EmbeddingDenseGrad. A negative
    padding_idx counts from the end, as in torch."""
    return _embedding_op(weight, indices, normalize_padding_idx(padding_idx, weight.shape[0]), scale_grad_by_freq)


def normalize_padding_idx(padding_idx, num_embeddings):
    """torch.nn.functional.embedding's rule: None -> -1 (none), negative ->
    counted from the end; out of [-num_embeddings, num_embeddings) is an error."""
    if padding_idx is None:
        return -1
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"padding_idx {padding_idx} must be within num_embeddings {num_embeddings}")
    return padding_idx + num_embeddings if padding_idx < 0 else padding_idx


def swiglu(x: torch.Tensor, dim: int = -1, *, eager: bool = False) -> torch.Tensor:
    """torch_npu's ``npu_swiglu``: ``silu(a) * b`` with ``a, b = x.chunk(2, dim)``,
    differentiable in x. ``eager=True`` rounds silu(a) to x's dtype before the
    product, as eager PyTorch's composite does."""
    return _swiglu_op(x, dim, eager)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, eager: bool = False) -> torch.Tensor:
    """``F.silu(gate) * up`` in one pass (Hugging Face's
    ``act_fn(gate_proj(x)) * up_proj(x)``), differentiable in both."""
    return _silu_mul_op(gate, up, eager)


def _approximate(approximate):
    """PyTorch's ``approximate`` string ("tanh", "none") or torch_npu's integer
    (1, 0) as the ops' integer; anything else is a ValueError."""
    value = {"tanh": 1, "none": 0, 1: 1, 0: 0}.get(approximate) if not isinstance(approximate, bool) else None
    if value is None:
        raise ValueError(f"approximate must be 'tanh' or 'none' (torch_npu: 1 or 0), not {approximate!r}")
    return value


def gelu_mul(gate: torch.Tensor, up: torch.Tensor, approximate="tanh", *, eager: bool = False) -> torch.Tensor:
    """``F.gelu(gate, approximate=approximate) * up`` in one pass (Gemma's
    ``act_fn(gate_proj(x)) * up_proj(x)`` with ``gelu_pytorch_tanh``),
    differentiable in both. ``eager=True`` rounds gelu(gate) to gate's dtype
    before the product, as eager PyTorch's composite does."""
    return _gelu_mul_op(gate, up, _approximate(approximate), eager)


def geglu(x: torch.Tensor, dim: int = -1, approximate="tanh", activate_left: bool = False, *,
          eager: bool = False):
    """torch_npu's ``npu_geglu``: ``(y, gelu(g))`` with ``y = u * gelu(g)``,
    ``u, g = x.chunk(2, dim)`` (``g, u`` with `activate_left`);
    differentiable in x through both outputs."""
    return _geglu_op(x, dim, _approximate(approximate), activate_left, eager)


def rotary_mul(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, eager: bool = False) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with cos/sin broadcast to x from the
    right (torch_npu's ``npu_rotary_mul`` in "half" mode); differentiable."""
    return _rotary_mul_op(x, cos, sin, eager)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, *, eager: bool = True):
    """Hugging Face's ``apply_rotary_pos_emb`` on npukern, with its signature
    (``unsqueeze_dim`` the fifth positional argument): q and k in one call.
    ``eager=True`` (the default) gives the composite's bits exactly (each
    product rounded to q's dtype, then the sum). q/k laid out
    [batch, heads, seq, head_dim] as transposed views of [batch, seq, heads,
    head_dim] (as the attention layers make them) are read in place."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    if not q.dtype == k.dtype == cos.dtype == sin.dtype:
        # Mixed dtypes (float32 tables beside 16-bit q/k): the composite's own
        # type promotion, as Hugging Face's function gives it.
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    # Contiguous q and k (decode: one position, where both layouts are the
    # same memory) go straight in: eight views fewer, the same bits.
    if unsqueeze_dim == 1 and q.dim() == 4 and cos.dim() == 4 and not (q.is_contiguous() and k.is_contiguous()) \
            and q.transpose(1, 2).is_contiguous() and k.transpose(1, 2).is_contiguous():
        # [b, s, h, d] memory: rotate there, with cos [b, s, 1, d]; return the same views.
        qo, ko = _rope_qk_op(q.transpose(1, 2), k.transpose(1, 2), cos.transpose(1, 2), sin.transpose(1, 2),
                             eager)
        return qo.transpose(1, 2), ko.transpose(1, 2)
    return _rope_qk_op(q, k, cos, sin, eager)


def matmul(a: torch.Tensor, b: torch.Tensor, *, trans_a: bool = False, trans_b: bool = False,
           out_dtype=None, math: str = "chain") -> torch.Tensor:
    """aclnnMatmul: ``op(a) @ op(b)`` of 2-D CPU tensors of one dtype (float32,
    bfloat16, float16), each element one float32 FMA chain over k ascending,
    rounded once to ``out_dtype`` (a's dtype, or float32): the same bits on
    every ISA and thread count. ``trans_a`` / ``trans_b`` read a stored
    ``[K, M]`` / ``[N, K]``; a transposed view of a contiguous tensor is read
    in place. Differentiable in both (the gradients are the same matmul).
    ``math="bf16_dot"`` (bfloat16 only) sums as VDPBF16PS does instead
    (pairs of k steps, the odd one first, subnormals flushed; the
    instruction where the CPU has AVX512-BF16), also the same bits
    everywhere; ``"bf16_dot_arm"`` (bfloat16 only) as Arm's BFDOT does
    (pairs, each sum rounded to odd: the instruction on AArch64 CPUs with
    BF16, an exact model many times slower elsewhere); ``"auto"``:
    :func:`npukern_torch.route.matmul_math`."""
    return _matmul_op(a, b, trans_a, trans_b, out_dtype, _route.resolve_math(math, a.dtype))


def _linear_takes(input, weight, bias):
    return (input.device.type == "cpu" and weight.device.type == "cpu" and input.dtype == weight.dtype
            and input.dtype in _route.DTYPES and input.dim() >= 1 and weight.dim() == 2
            and (bias is None or (bias.dtype == input.dtype and bias.device.type == "cpu"))
            and type(input) is torch.Tensor and type(weight) in (torch.Tensor, torch.nn.Parameter))


def _autocast(t, dt):
    if t is None or not t.dtype.is_floating_point or t.dtype == torch.float64 or t.device.type != "cpu":
        return t
    return t.to(dt)


def linear(input: torch.Tensor, weight: torch.Tensor, bias=None, *, route: bool = False,
           math=None) -> torch.Tensor:
    """``F.linear(input, weight, bias)`` on npukern's matmul: ``y = x W^T + b``
    in float32 FMA, rounded once (the bias starts each sum), and in the
    backward ``dx = dy W`` and ``dW = dy^T x`` (summed over every token in
    float32, rounded once), ``db`` summed in float32. Under CPU autocast the
    operands are cast to its dtype first, as autocast's linear does. What the
    kernel does not take (float64, non-CPU tensors, mixed dtypes, tensor
    subclasses) runs ``F.linear``; so does every call when ``route`` is true
    and :func:`npukern_torch.route.matmul_route` keeps torch's matmul for
    that dtype on this CPU (what :func:`npukern_torch.hf.patch` passes).
    ``math`` sums the three products as :func:`matmul`'s does (``"chain"``,
    ``"bf16_dot"``, ``"auto"``); None, the default: ``"auto"`` with
    ``route``, the FMA chain without."""
    if input.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # Autocast's rule: CPU floating tensors but float64 are cast.
        dt = torch.get_autocast_dtype("cpu")
        input, weight, bias = (_autocast(t, dt) for t in (input, weight, bias))
    if not _linear_takes(input, weight, bias) or (route and not _route.matmul_route(input.dtype)):
        return torch.nn.functional.linear(input, weight, bias)
    m = _route.resolve_math(math or ("auto" if route else "chain"), input.dtype)
    with torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") else _NULL:
        return _linear_op(input, weight, bias, m)


def _attention_takes(q, k, v, attn_mask, dropout_p, enable_gqa):
    """Whether npukern's attention computes this SDPA call."""
    plain = (torch.Tensor, torch.nn.Parameter)
    if attn_mask is not None or dropout_p != 0.0:
        return False
    if not all(type(t) in plain and t.device.type == "cpu" and t.dim() == 4 for t in (q, k, v)):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in _route.DTYPES):
        return False
    hq, hkv = q.shape[1], k.shape[1]
    return (k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3] and q.shape[3] > 0
            and hkv > 0 and (hkv == hq or (enable_gqa and hq % hkv == 0)) and (k.shape[2] > 0 or q.shape[2] == 0))


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale=None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on npukern's
    Attention (aclnnFlashAttentionScore's analog) where it takes the call:
    no ``attn_mask``, no dropout, CPU tensors ``[B, H, S, D]`` of one dtype
    (float32, bfloat16, float16), k and v with H heads, or (``enable_gqa``)
    a number dividing it. ``is_causal``: query i sees keys ``j <= i``, as
    torch's (top-left). Inside, float32: each score one FMA chain, the
    softmax's sum in a fixed order, each output rounded once; the backward
    (dq, dk, dv; dk and dv summed over a group's heads and the rows in one
    order) recomputes the probabilities bit for bit: the same bits on every
    ISA and thread count. q, k and v that are the per-head views of
    ``[B, S, H, D]`` tensors (``x.view(B, S, H, D).transpose(1, 2)``) are
    read in place and the output is such a view too. Under CPU autocast the
    inputs are cast to its dtype first. Anything else runs torch's."""
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        dt = torch.get_autocast_dtype("cpu")
        query, key, value = (_autocast(t, dt) for t in (query, key, value))
    if not _attention_takes(query, key, value, attn_mask, dropout_p, enable_gqa):
        kw = {"enable_gqa": True} if enable_gqa else {}
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
                                                                scale=scale, **kw)
    with torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") else _NULL:
        return _attention_op(query, key, value, bool(is_causal), None if scale is None else float(scale))[0]

