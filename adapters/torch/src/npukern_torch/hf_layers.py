"""Layers for the Hugging Face `kernels` route (``kernelize`` / transformers'
``KernelConfig``): stateless classes whose ``forward`` replaces the decorated
transformers layer's and reads that module's own ``weight`` and eps."""

import torch

from . import functional as F


class LlamaRMSNorm(torch.nn.Module):
    """The Llama-family RMSNorm (Llama, Mistral, Qwen2, Qwen3: all decorated
    ``use_kernel_forward_from_hub("RMSNorm")``) on npukern, with their bits:
    the normalized x rounded to x's dtype, then times the weight."""

    can_torch_compile = True
    has_backward = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.device.type != "cpu" or hidden_states.dtype == torch.float64:
            variance = hidden_states.float().pow(2).mean(-1, keepdim=True)
            normalized = hidden_states.float() * torch.rsqrt(variance + self.variance_epsilon)
            return self.weight * normalized.to(hidden_states.dtype)
        return F.rms_norm(hidden_states, self.weight, self.variance_epsilon, casting="llama")[0]


class GemmaRMSNorm(torch.nn.Module):
    """The Gemma-family RMSNorm on npukern: ``(1 + weight)`` in fp32, one rounding."""

    can_torch_compile = True
    has_backward = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype == torch.float64:
            normalized = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return (normalized * (1.0 + self.weight.float())).type_as(x)
        weight = self.weight if self.weight.dtype in (x.dtype, torch.float32) else self.weight.float()
        return F.rms_norm(x, weight, self.eps, casting="gemma")[0]
