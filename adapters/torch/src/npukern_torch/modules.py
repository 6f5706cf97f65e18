"""Drop-in modules: subclasses of torch.nn.RMSNorm and torch.nn.Embedding
(same constructor arguments, defaults, parameters and state_dict) whose
forward and backward run npukern's kernels."""

import torch

from . import _casting
from . import functional as F
from ._dtypes import KERNEL_DTYPES, on_kernels
from ._fast import add_rms_norm_module as _add_rms_norm_module
from ._fast import is_compiling as _is_compiling
from ._fast import rms_norm_module as _rms_norm_module

_F32_EPS = torch.finfo(torch.float32).eps
_embedding_op = F._embedding_op  # the eager caller (_fast.py)


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm on npukern's RmsNorm / RmsNormGrad.

    ``casting`` chooses a model family's numerics, forward and backward:
    ``"torch"`` (default: fp32 inside, one rounding, as torch.nn.RMSNorm),
    ``"llama"`` (the normalized x rounded to x's dtype, then times the weight
    with torch's type promotion: Hugging Face Llama / Mistral / Qwen), or
    ``"gemma"`` (``(1 + weight)`` in fp32, one rounding). ``offset`` sets any
    other ``(offset + weight)``. The backward is the gradient of that mode's
    composite.

    ``eps=None`` means what it means in torch: the machine epsilon of the
    computation type, ``torch.finfo(torch.float32).eps`` for float32, float16
    and bfloat16 inputs. With ``elementwise_affine=False`` the kernel is given
    a float32 gamma of ones (a non-persistent buffer, not in the state_dict).
    Outside "llama", a weight whose dtype is neither x's nor float32 is used
    as float32. Inputs the kernels do not take (float64, non-CPU tensors)
    run the same numerics in torch ops.
    """

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None, *,
                 casting="torch", offset=None):
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        self.offset, self.cast_before_gamma = _casting.resolve(casting, offset)
        self.casting = casting
        if not elementwise_affine:
            ones = torch.ones(self.normalized_shape, device=device, dtype=torch.float32)
            self.register_buffer("_ones", ones, persistent=False)

    def _gamma(self, x):
        # From _parameters directly: `self.weight` is a Module.__getattr__
        # call, about 1 us on a Cascade Lake core. A parametrized weight
        # (torch.nn.utils.parametrize) is a property instead: read it so.
        params = self._parameters
        gamma = params["weight"] if "weight" in params else self.weight
        if gamma is None:
            gamma = self._ones
        if not self.cast_before_gamma and gamma.dtype != x.dtype and gamma.dtype != torch.float32:
            gamma = gamma.float()
        return gamma

    def _eps(self, x):
        return self.eps if self.eps is not None else _F32_EPS

    def _torch_norm(self, x):
        """The same numerics in torch ops, for inputs the kernels do not take."""
        dims = tuple(range(-len(self.normalized_shape), 0))
        xf = x.float() if x.dtype in KERNEL_DTYPES else x
        normalized = xf * torch.rsqrt(xf.square().mean(dims, keepdim=True) + self._eps(x))
        gamma = self._gamma(x) + self.offset if self.offset else self._gamma(x)
        if self.cast_before_gamma:
            return normalized.to(x.dtype) * gamma
        return (normalized * gamma.to(normalized.dtype)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _rms_norm_module is not None and not _is_compiling():
            # Eager: one C call for the common case (plain CPU tensors, gamma
            # as it is); NotImplemented sends anything else down the path below.
            params = self._parameters
            eps = self.eps
            y = _rms_norm_module(x, params["weight"] if "weight" in params else self.weight,
                                 _F32_EPS if eps is None else eps, self.offset, self.cast_before_gamma)
            if y is not NotImplemented:
                return y
        if not on_kernels(x):
            if self.casting == "torch" and not self.offset:
                return super().forward(x)
            return self._torch_norm(x)
        # F.rms_norm with the casting resolved once, in __init__ (and _eps inline).
        eps = self.eps
        return F._rms_norm(x, self._gamma(x), _F32_EPS if eps is None else eps, self.offset,
                           self.cast_before_gamma)[0]

    def extra_repr(self):
        s = super().extra_repr()
        if self.casting != "torch":
            s += f", casting={self.casting!r}"
        if self.offset != (1.0 if self.casting == "gemma" else 0.0):
            s += f", offset={self.offset}"
        return s


class AddRMSNorm(RMSNorm):
    """RMSNorm of ``x + residual`` fused with the add: ``forward(x, residual)``
    returns ``(y, x + residual)``, the normalized output and the new residual
    stream (torch_npu's npu_add_rms_norm as a module); ``casting`` and
    ``offset`` as in :class:`RMSNorm`."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor):
        """``(rms_norm(x + residual), x + residual)``, the sum with torch's
        broadcasting and type promotion. The fused kernel runs when x and
        residual have one shape and one dtype the kernels take; any other
        pair is added by torch first, then normalized by the RMSNorm kernel
        (or torch ops for dtypes the kernels do not take)."""
        if _add_rms_norm_module is not None and not _is_compiling():
            params = self._parameters
            eps = self.eps
            out = _add_rms_norm_module(x, residual, params["weight"] if "weight" in params else self.weight,
                                       _F32_EPS if eps is None else eps, self.offset, self.cast_before_gamma)
            if out is not NotImplemented:
                return out
        if x.dtype == residual.dtype and on_kernels(x, residual) and x.shape == residual.shape:
            eps = self.eps
            y, _rstd, s = F._add_rms_norm(x, residual, self._gamma(x), _F32_EPS if eps is None else eps,
                                          self.offset, self.cast_before_gamma)
            return y, s
        s = x + residual
        return super().forward(s), s


class Embedding(torch.nn.Embedding):
    """torch.nn.Embedding whose weight gradient is npukern's
    EmbeddingDenseGrad (f32 sums in ascending position order, one rounding;
    padding_idx and scale_grad_by_freq as in torch). ``sparse=True`` and
    ``max_norm`` are refused: the kernel computes a dense gradient and does
    not renormalize rows. Weights the kernels do not take (float64, non-CPU)
    run torch's own embedding."""

    def __init__(
        self,
        num_embeddings,
        embedding_dim,
        padding_idx=None,
        max_norm=None,
        norm_type=2.0,
        scale_grad_by_freq=False,
        sparse=False,
        _weight=None,
        _freeze=False,
        device=None,
        dtype=None,
    ):
        if sparse:
            raise ValueError(
                "npukern_torch.Embedding: sparse=True is not supported (npukern computes the dense "
                "weight gradient); use torch.nn.Embedding for sparse gradients"
            )
        if max_norm is not None:
            raise ValueError(
                "npukern_torch.Embedding: max_norm is not supported (npukern does not renormalize "
                "rows in the forward); use torch.nn.Embedding for max_norm"
            )
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            _weight,
            _freeze,
            device,
            dtype,
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = self.weight  # once: a parameter is a Module.__getattr__ call
        if not on_kernels(weight):
            return super().forward(input)
        padding_idx = -1 if self.padding_idx is None else self.padding_idx
        return _embedding_op(weight, input, padding_idx, self.scale_grad_by_freq)
