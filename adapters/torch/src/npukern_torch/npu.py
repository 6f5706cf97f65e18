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

fp32 inside, one rounding; differentiable (npu_rotary_mul in r1 and r2 too).

Inputs the kernels do not take (float64, non-CPU tensors) run the same
formulas as torch ops in x's dtype (``model.double()`` keeps working)."""

import torch

from . import _composite
from . import functional as _F
from ._dtypes import KERNEL_DTYPES, on_kernels


def _torch_rms_norm(x, gamma, epsilon):
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float() if x.dtype in KERNEL_DTYPES else x
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + epsilon)
    return (xf * rstd * gamma.to(xf.dtype)).to(x.dtype), rstd.float()

__all__ = ["npu_add_rms_norm", "npu_cross_entropy_loss", "npu_geglu", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"]


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
