"""What npukern's kernels take: float32, float16 and bfloat16 tensors on the
CPU. Every module, op wrapper and Hugging Face swap asks here before
calling a kernel; anything else runs torch ops."""

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def on_kernels(*tensors: torch.Tensor) -> bool:
    """True when every tensor is one the kernels take. (A loop over
    ``is_cpu``: every module call asks, and ``all`` over a generator of
    ``t.device.type`` cost more than the check itself.)"""
    for t in tensors:
        if t.dtype not in KERNEL_DTYPES or not t.is_cpu:
            return False
    return True
