"""torch_npu's fused norm calls on npukern, so code written for an Ascend NPU
runs unchanged on a CPU: ``import npukern_torch.npu as torch_npu``.

- ``npu_rms_norm(x, gamma, epsilon=1e-06) -> (y, rstd)``
- ``npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (y, rstd, x_sum)``

with torch_npu's signatures and outputs: fp32 inside, one rounding of y to
x's dtype, rstd float32 with x's shape and the normalized dims set to 1,
differentiable in x (x1, x2) and gamma. A gamma whose dtype is neither x's
nor float32 is used as float32.

- ``npu_swiglu(x, dim=-1) -> silu(a) * b`` with ``a, b = x.chunk(2, dim)``
- ``npu_geglu(x, dim=-1, approximate=1, activate_left=False) -> (y, gelu)``:
  ``a, b = x.chunk(2, dim)``, ``y = a * gelu(b)`` (``gelu(a) * b`` with
  ``activate_left``), ``gelu`` the activated half's GELU; approximate 1 the
  tanh form, 0 the erf form
- ``npu_rotary_mul(x, r1, r2, rotary_mode="half") -> x * r1 + rotate_half(x) * r2``
- ``npu_fusion_attention(query, key, value, head_num, input_layout, ...) ->
  (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``:
  FlashAttentionScore on npukern's Attention (see its docstring for what
  runs on the kernel and what on a float32 composite)

fp32 inside, one rounding; differentiable (npu_rotary_mul in r1 and r2 too).

Inputs the kernels do not take (float64, non-CPU tensors) run the same
formulas as torch ops in x's dtype (``model.double()`` keeps working)."""

import math

import torch

from . import _composite
from . import functional as _F
from ._dtypes import KERNEL_DTYPES, on_kernels


def _torch_rms_norm(x, gamma, epsilon):
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float() if x.dtype in KERNEL_DTYPES else x
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.to(xf.dtype)).to(x.dtype), rstd.float()

__all__ = [
    "npu_add_rms_norm",
    "npu_fusion_attention",
    "npu_apply_adam_w",
    "npu_apply_fused_adamw_v2",
    "npu_cross_entropy_loss",
    "npu_geglu",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
]


def _gamma(x, gamma):
    return gamma if gamma.dtype in (x.dtype, torch.float32) else gamma.float()


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    """torch_npu.npu_rms_norm: ``(y, rstd)``."""
    if not on_kernels(x, gamma):
        return _torch_rms_norm(x, gamma, epsilon)
    return _F.rms_norm(x, _gamma(x, gamma), epsilon)


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-06):
    """torch_npu.npu_add_rms_norm: ``(y, rstd, x1 + x2)``."""
    if not on_kernels(x1, x2, gamma) or x1.dtype != x2.dtype or x1.shape != x2.shape:
        x_sum = x1 + x2
        return (*npu_rms_norm(x_sum, gamma, epsilon), x_sum)
    return _F.add_rms_norm(x1, x2, _gamma(x1, gamma), epsilon)


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """torch_npu.npu_swiglu: ``silu(a) * b`` with ``a, b = x.chunk(2, dim)``."""
    if not on_kernels(x):
        a, b = x.chunk(2, dim)
        return torch.nn.functional.silu(a) * b
    return _F.swiglu(x, dim)


def npu_geglu(self: torch.Tensor, dim: int = -1, approximate: int = 1, activate_left: bool = False):
    """torch_npu.npu_geglu: ``(y, gelu)``, the gate the second half of
    ``self`` along dim (the first with ``activate_left``); ``approximate`` 1
    the tanh form, 0 the erf form."""
    if approximate not in (0, 1) or isinstance(approximate, bool):
        raise ValueError(f"npu_geglu: approximate must be 0 (none) or 1 (tanh), not {approximate!r}")
    if not on_kernels(self):
        a, b = self.chunk(2, dim)
        gate, up = (a, b) if activate_left else (b, a)
        gelu = torch.nn.functional.gelu(gate, approximate="tanh" if approximate else "none")
        return gelu * up, gelu
    return _F.geglu(self, dim, approximate, activate_left)


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """torch_npu.npu_rotary_mul: ``x * r1 + rotate_half(x) * r2`` (r1, r2
    broadcast to x; "half" mode, the one Hugging Face models use)."""
    if rotary_mode != "half":
        raise ValueError(f"npu_rotary_mul: rotary_mode {rotary_mode!r} is not supported (only 'half')")
    if not on_kernels(x, r1, r2):
        return x * r1 + _composite.rotate_half(x) * r2
    return _F.rotary_mul(x, _gamma(x, r1), _gamma(x, r2))


def npu_cross_entropy_loss(input: torch.Tensor, target: torch.Tensor, weight=None, reduction: str = "mean",
                           ignore_index: int = -100, label_smoothing: float = 0.0,
                           lse_square_scale_for_zloss: float = 0.0, return_zloss: bool = False):
    """torch_npu.npu_cross_entropy_loss: ``(loss, log_prob, zloss, lse_for_zloss)``
    for ``input`` ``[N, C]``: the loss (float32, z-loss included when
    ``lse_square_scale_for_zloss`` is set) with the reduction, the log-softmax
    ``input - lse`` (float32 ``[N, C]``), the z-loss term alone (reduced like
    the loss; zeros unless ``return_zloss``) and the per-row lse (float32)."""
    from . import loss as _loss

    red = _loss._reduction(reduction)
    if not on_kernels(input):
        x = input.float()
        lse = torch.logsumexp(x, -1)
        log_prob = x - lse.unsqueeze(-1)
        loss = _loss._composite(x, target, weight, ignore_index, reduction, label_smoothing,
                                lse_square_scale_for_zloss, 0.0)
    else:
        w = None if weight is None else weight.float()
        loss, lse = torch.ops.npukern.cross_entropy(input.contiguous(), target.contiguous(), w, red, ignore_index,
                                                    float(label_smoothing), float(lse_square_scale_for_zloss), 0.0)
        if input.requires_grad and torch.is_grad_enabled():
            # log_prob and zloss are differentiable through lse (it was
            # detached here, so log_prob back-propagated ones).
            lse = _KernelLse.apply(input, lse)
        log_prob = input.float() - lse.unsqueeze(-1)
    keep = (target != ignore_index).float()
    z = lse_square_scale_for_zloss * lse.square() * keep if return_zloss else torch.zeros_like(keep)
    zloss = {0: z, 1: z.sum(), 2: z.sum() / keep.sum()}[red]
    return loss, log_prob, zloss, lse.detach()


class _KernelLse(torch.autograd.Function):
    """The kernel's per-row lse as a function of the logits ``[N, C]``:
    ``d lse / d x = softmax(x)``, torch's float32 softmax (exact at any
    offset of the logits)."""

    @staticmethod
    def forward(ctx, x, lse):
        ctx.save_for_backward(x)
        return lse.clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        p = torch.softmax(x.float(), -1)
        return (g.float().unsqueeze(-1) * p).to(x.dtype), None


def _step_of(power, beta, name):
    """The step t with beta^(t-1) nearest to power (torch_npu passes the
    previous step's powers, exact or as float32 computes them), or None
    when the power says nothing of the step: beta 0 past step 1, or a power
    that underflowed to 0 (0.9^7199). ValueError when it is no power of a
    beta at all."""
    p = float(power)
    if not 0.0 <= p <= 1.0 or not 0.0 <= beta < 1.0:
        raise ValueError(f"npu_apply_adam_w: {name} {p} is not a power of beta {beta} (want 0 <= {name} <= 1)")
    if p == 1.0:
        return 1
    if p == 0.0 or beta == 0.0:
        return None
    return max(1, round(math.log(p) / math.log(beta)) + 1)


def _step_of_powers(beta1_power, beta2_power, beta1, beta2):
    """The step both powers name (the one that still carries it when the
    other has underflowed or its beta is 0); at most a step apart, as float32
    powers can be; ValueError when they name different steps."""
    t1 = _step_of(beta1_power, beta1, "beta1_power")
    t2 = _step_of(beta2_power, beta2, "beta2_power")
    if t1 is not None and t2 is not None and abs(t1 - t2) > 1:
        raise ValueError(f"npu_apply_adam_w: beta1_power and beta2_power are powers of different steps ({t1} and "
                         f"{t2})")
    if t2 is not None:  # beta2 (0.999) underflows last and resolves a step best
        return t2
    if t1 is not None:
        return t1
    # Neither names it (a beta of 0, or a power underflowed to 0): any step
    # whose powers are 0 too gives the same bias corrections (1).
    return max([2] + [2 + math.ceil(math.log(5e-324) / math.log(b)) for b in (beta1, beta2) if b > 0.0])


def _same_shape(fn, name, t, like):
    if t.shape != like.shape:
        raise ValueError(f"{fn}: {name} has shape {list(t.shape)}, param {list(like.shape)} (they must match)")


def npu_apply_adam_w(beta1_power, beta2_power, lr, weight_decay, beta1, beta2, epsilon, grad, max_grad_norm=None,
                     amsgrad=False, maximize=False, *, out):
    """torch_npu's ``npu_apply_adam_w``: one AdamW step of ``out = (var, m, v)``
    in place, on npukern's AdamW (``torch.ops.npukern.adamw_``). As in
    torch_npu, ``beta1_power`` / ``beta2_power`` are the previous step's
    powers (``beta^(t-1)``; the update uses ``beta^t``), and with ``amsgrad``
    ``max_grad_norm`` is the running maximum of ``v`` (a tensor like ``v``,
    updated in place). Decoupled weight decay ``var *= 1 - lr * weight_decay``.
    npukern derives the step from the powers (the nearest integer power:
    exact float64 powers, float32 ones as MindSpeed passes them, a beta1
    power that underflowed to 0 past step ~7 100 at 0.9, a beta of 0) and
    forms the bias corrections in float64; the denominator is
    ``sqrt(v) / sqrt(1 - beta2^t) + eps`` (torch_npu: ``sqrt(v / (1 - beta2^t))
    + eps``, the same to rounding). Returns ``(var, m, v)``."""
    var, m, v = out
    t = _step_of_powers(beta1_power, beta2_power, float(beta1), float(beta2))
    for name, x in (("grad", grad), ("m", m), ("v", v)):
        _same_shape("npu_apply_adam_w", name, x, var)
    flags = (1 if amsgrad else 0) | (2 if maximize else 0)
    maxes = []
    if amsgrad:
        if not isinstance(max_grad_norm, torch.Tensor):
            raise TypeError("npu_apply_adam_w: amsgrad needs max_grad_norm, the running max of v (a tensor)")
        _same_shape("npu_apply_adam_w", "max_grad_norm", max_grad_norm, var)
        maxes = [max_grad_norm]
    torch.ops.npukern.adamw_([var], [grad], [m], [v], maxes, [], float(lr), float(beta1), float(beta2),
                             float(epsilon), float(weight_decay), t, flags, 0.0, 1.0, 0.0, 1.0, [], [], [])
    return var, m, v


def npu_apply_fused_adamw_v2(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, state_step, lr=1e-3, beta1=0.9,
                             beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False):
    """MindSpeed's ``npu_apply_fused_adamw_v2`` (mindspeed.ops): one AdamW
    step of ``param``, ``exp_avg``, ``exp_avg_sq`` (and with ``amsgrad``
    ``max_exp_avg_sq``, the running max of ``exp_avg_sq``) in place, on
    npukern's AdamW. As MindSpeed: ``state_step`` is the current step (an int
    or a one-element int64 tensor, >= 1; the bias corrections use
    ``beta^state_step``), the moments have ``param``'s dtype, ``grad`` and
    ``max_exp_avg_sq`` any of float32 / float16 / bfloat16, decoupled weight
    decay, float32 arithmetic with one rounding to each output's dtype
    (MindSpeed's reference computes 16-bit params in float32 and casts back).
    A ``max_exp_avg_sq`` of another dtype than the moments is updated through
    the moments' dtype (one more rounding). Returns nothing, as MindSpeed."""
    step = int(state_step.item() if isinstance(state_step, torch.Tensor) else state_step)
    if step < 1:
        raise ValueError(f"npu_apply_fused_adamw_v2: state_step {step} is not a step (>= 1)")
    if exp_avg.dtype != param.dtype or exp_avg_sq.dtype != param.dtype:
        raise TypeError("npu_apply_fused_adamw_v2: exp_avg and exp_avg_sq must have param's dtype "
                        f"({param.dtype}); got {exp_avg.dtype}, {exp_avg_sq.dtype}")
    for name, x in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        _same_shape("npu_apply_fused_adamw_v2", name, x, param)
    flags = (1 if amsgrad else 0) | (2 if maximize else 0)
    maxes, back = [], None
    if amsgrad:
        if not isinstance(max_exp_avg_sq, torch.Tensor):
            raise TypeError("npu_apply_fused_adamw_v2: amsgrad needs max_exp_avg_sq (a tensor)")
        _same_shape("npu_apply_fused_adamw_v2", "max_exp_avg_sq", max_exp_avg_sq, param)
        if max_exp_avg_sq.dtype != exp_avg_sq.dtype:
            back, max_exp_avg_sq = max_exp_avg_sq, max_exp_avg_sq.to(exp_avg_sq.dtype)
        maxes = [max_exp_avg_sq]
    torch.ops.npukern.adamw_([param], [grad], [exp_avg], [exp_avg_sq], maxes, [], float(lr), float(beta1),
                             float(beta2), float(eps), float(weight_decay), step, flags, 0.0, 1.0, 0.0, 1.0, [], [], [])
    if back is not None:
        back.copy_(max_exp_avg_sq)


_NO_BAND = 2147483647


def _heads_view(t, layout, heads):
    """``t`` (in torch_npu's ``input_layout``) as a ``[B, N, S, D]`` view."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, n, h = t.shape
        return t.view(b, n, heads, h // heads).transpose(1, 2)
    if layout == "SBH":
        n, b, h = t.shape
        return t.view(n, b, heads, h // heads).permute(1, 2, 0, 3)
    raise NotImplementedError(f"npu_fusion_attention: input_layout {layout!r} (BSH, SBH, BSND, BNSD are taken; "
                              "TND's variable lengths are not)")


def _from_heads(o, layout, like):
    """The ``[B, N, S, D]`` output back in ``input_layout`` (query's shape)."""
    if layout == "BNSD":
        return o
    if layout == "BSND":
        return o.transpose(1, 2)
    if layout == "BSH":
        return o.transpose(1, 2).reshape(like.shape)
    return o.permute(2, 0, 1, 3).reshape(like.shape)


def _causal_mask(sq, skv, device):
    """torch_npu's causal ``atten_mask``: True where query i must not see key j > i."""
    return torch.ones(sq, skv, dtype=torch.bool, device=device).triu(1)


def _is_causal_mask(mask, sq, skv):
    """Whether a bool ``atten_mask`` (SS, 11SS, B1SS or BNSS) masks exactly the
    keys after each query, the same in every batch and head."""
    if mask is None or mask.dtype not in (torch.bool, torch.uint8) or mask.shape[-2:] != (sq, skv):
        return False
    return bool((mask.bool() == _causal_mask(sq, skv, mask.device)).all())


def _attention_composite(q, k, v, mask, scale, keep_prob, pse):
    """FlashAttentionScore's formula in float32 torch ops (differentiable):
    ``softmax(mask(scale (q k^T + pse))) v`` with dropout ``1 - keep_prob``;
    and each row's max and sum."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2))
    if pse is not None:
        s = s + pse.float()
    s = s * scale
    if mask is not None:
        s = s.masked_fill(mask.bool(), float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    p = e / total
    if keep_prob < 1.0:
        p = torch.nn.functional.dropout(p, 1.0 - keep_prob)
    out = torch.matmul(p, v.float()).to(q.dtype)
    return out, m.squeeze(-1), total.detach().squeeze(-1)


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=_NO_BAND, next_tockens=_NO_BAND, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False):
    """torch_npu's ``npu_fusion_attention`` (FlashAttentionScore):
    ``(attention_out, softmax_max, softmax_sum, softmax_out, seed, offset,
    numels)`` with ``attention_out`` in ``input_layout`` (BSH, SBH, BSND,
    BNSD; key and value may have fewer heads, dividing ``head_num``),
    ``softmax_max`` / ``softmax_sum`` float32 ``[B, N, Sq, 8]`` (each row's
    max of the scaled scores and sum of ``e^(s - max)``, repeated 8 times as
    torch_npu's), ``softmax_out`` empty and ``seed = offset = numels = 0``;
    differentiable in query, key, value.

    npukern's Attention computes it (f32 inside, the same bits on every ISA
    and thread count; docs/operators.md "Attention") when there is no
    ``pse``, no dropout (``keep_prob`` 1), no ``prefix`` and the mask is
    none or causal: ``sparse_mode`` 2 (leftUpCausal: the mask argument is
    the compressed triangle and is not read), 3 (rightDownCausal) with as
    many keys as queries, or 0 with an ``atten_mask`` that masks exactly the
    keys after each query (or ``next_tockens=0``) and no other band. Any
    other mask, band, ``pse`` or dropout runs a float32 composite of the
    same formula (torch's dropout, not the NPU's random bits). ``TND`` and
    the ``actual_seq_*`` lengths are not taken (NotImplementedError)."""
    if input_layout == "TND" or actual_seq_qlen is not None or actual_seq_kvlen is not None:
        raise NotImplementedError("npu_fusion_attention: TND and actual_seq_qlen / actual_seq_kvlen "
                                  "(variable-length batches) are not taken on the CPU")
    q = _heads_view(query, input_layout, head_num)
    d = q.shape[-1]
    kv_heads = key.shape[-1] // d if input_layout in ("BSH", "SBH") else None
    k = _heads_view(key, input_layout, kv_heads)
    v = _heads_view(value, input_layout, kv_heads)
    if q.shape[1] != head_num:
        raise ValueError(f"npu_fusion_attention: query has {q.shape[1]} heads in {input_layout}, head_num is "
                         f"{head_num}")
    sq, skv = q.shape[2], k.shape[2]
    default_band = pre_tockens == _NO_BAND and next_tockens == _NO_BAND
    if sparse_mode == 2:
        causal, mask = True, None
    elif sparse_mode == 3:
        if sq == skv:
            causal, mask = True, None
        else:  # bottom-right: query i sees keys j <= i + skv - sq
            causal, mask = False, torch.ones(sq, skv, dtype=torch.bool, device=q.device).triu(1 + skv - sq)
    elif sparse_mode == 0 and atten_mask is None and default_band:
        causal, mask = False, None
    elif sparse_mode == 0 and pre_tockens == _NO_BAND and (
            (default_band and _is_causal_mask(atten_mask, sq, skv))
            or (next_tockens == 0 and (atten_mask is None or _is_causal_mask(atten_mask, sq, skv)))):
        causal, mask = True, None
    elif sparse_mode in (0, 1):
        causal = False
        mask = atten_mask
        if sparse_mode == 0 and not default_band:
            i = torch.arange(sq, device=q.device).unsqueeze(1)
            j = torch.arange(skv, device=q.device).unsqueeze(0)
            band = (j > i + next_tockens) | (j < i - pre_tockens)
            mask = band if mask is None else (mask.bool() | band)
    else:
        raise NotImplementedError(f"npu_fusion_attention: sparse_mode {sparse_mode} (0-3 are taken)")
    takes = (causal or mask is None) and pse is None and keep_prob == 1.0 and prefix is None and \
        _F._attention_takes(q, k, v, None, 0.0, True)
    if takes:
        out, mx, sm = torch.ops.npukern.attention(q, k, v, bool(causal), float(scale))
    else:
        if causal:
            mask = _causal_mask(sq, skv, q.device)
        out, mx, sm = _attention_composite(q, k, v, mask, float(scale), float(keep_prob), pse)
    stat = (q.shape[0], q.shape[1], sq, 8)
    return (_from_heads(out, input_layout, query), mx.unsqueeze(-1).expand(stat).contiguous(),
            sm.unsqueeze(-1).expand(stat).contiguous(), query.new_empty(0), 0, 0, 0)

