"""DeepSpeed's CPU Adam comparison (its tests/unit/ops/adam/test_cpu_adam.py:
sizes that are not SIMD multiples, float32 and bfloat16 params, ten steps
with fresh random gradients, against ``torch.optim.AdamW`` on copies of the
same params), written for npukern_torch.optim.AdamW (no DeepSpeed code or
install needed). Tolerances: float32 1e-5 relative (DeepSpeed allows 1e-2
absolute); bfloat16 DeepSpeed's 1e-2 absolute, and no further from a float64
AdamW on average than torch's (both round each step's param to bf16, which
loses updates below bf16's step: what master_weights is for)."""

import pytest
import torch

from npukern_torch.optim import AdamW

SIZES = [22, 55, 64, 128, 1024, 1048576, 1048576 + 7]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ten_steps_against_torch_adamw(size, dtype):
    g = torch.Generator().manual_seed(size)
    init = torch.randn(size, generator=g)
    ours_p = torch.nn.Parameter(init.clone().to(dtype))
    ref_p = torch.nn.Parameter(init.clone().to(dtype))
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    ours, ref = AdamW([ours_p], **kw), torch.optim.AdamW([ref_p], **kw)
    for _ in range(10):
        grad = torch.randn(size, generator=g).to(dtype)
        ours_p.grad, ref_p.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    a, b = ours_p.detach().double(), ref_p.detach().double()
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        return
    assert (a - b).abs().max().item() <= 1e-2
    exact_p = torch.nn.Parameter(init.clone().double())
    exact = torch.optim.AdamW([exact_p], **kw)
    g = torch.Generator().manual_seed(size)
    torch.randn(size, generator=g)
    for _ in range(10):
        exact_p.grad = torch.randn(size, generator=g).to(dtype).double()
        exact.step()
    e = exact_p.detach()
    assert (a - e).abs().mean().item() <= 1.01 * (b - e).abs().mean().item() + 1e-12
