"""npukern_torch.npu (torch_npu's calls, so NPU code runs unchanged on a
CPU) and import hygiene: every module imports as the first import of a
fresh interpreter, and the tests import the installed package, not the
source tree, from the repository root and from adapters/torch."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import rand
from hf_models import build, tokens

HERE = Path(__file__).resolve().parent
ADAPTER = HERE.parent


@pytest.mark.parametrize("module", [pytest.param(m, marks=pytest.mark.torch_only) for m in (
    "npukern_torch", "npukern_torch.parallel", "npukern_torch.npu")] + ["npukern_torch.hf"])
def test_first_import_of_a_fresh_interpreter(module, tmp_path):
    out = subprocess.run([sys.executable, "-c", f"import {module}; print({module}.__name__)"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.torch_only
@pytest.mark.parametrize("cwd", [ADAPTER.parent.parent, ADAPTER], ids=["repo root", "adapters/torch"])
def test_the_installed_package_is_imported(cwd):
    out = subprocess.run([sys.executable, "-c", "import npukern_torch; print(npukern_torch.__file__)"], cwd=cwd,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "site-packages" in out.stdout, out.stdout


def test_npu_rms_norm_signatures_and_outputs(gen):
    import npukern_torch.npu as torch_npu

    x = rand((3, 5, 64), torch.bfloat16, -3, 3, gen=gen)
    gamma = rand((64,), torch.bfloat16, 0.5, 1.5, gen=gen)
    y, rstd = torch_npu.npu_rms_norm(x, gamma, epsilon=1e-6)
    assert y.dtype == x.dtype and rstd.dtype == torch.float32 and rstd.shape == (3, 5, 1)
    want = (x.double() * torch.rsqrt(x.double().square().mean(-1, keepdim=True) + 1e-6) * gamma.double())
    assert ((y.double() - want).abs() <= 2**-8 * want.abs() + 1e-30).all()
    x2 = rand((3, 5, 64), torch.bfloat16, -3, 3, gen=gen)
    y2, rstd2, x_sum = torch_npu.npu_add_rms_norm(x, x2, gamma, epsilon=1e-6)
    assert torch.equal(x_sum, x + x2) and torch.equal(y2, torch_npu.npu_rms_norm(x + x2, gamma)[0])


def test_the_seeds_replacement_class_runs_unchanged():
    """The torch_npu replacement recipe for a Llama's RMSNorm, as written for
    an NPU, with only the import changed: the model trains and matches the
    stock model's torch numerics (one rounding, so within 1 bf16 ulp per norm)."""
    import npukern_torch.npu as torch_npu
    import transformers.models.llama.modeling_llama as modeling

    class NPURMSNorm(torch.nn.Module):
        def __init__(self, hidden_size, eps=1e-6):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.variance_epsilon = eps

        def forward(self, hidden_states):
            return torch_npu.npu_rms_norm(hidden_states, self.weight, epsilon=self.variance_epsilon)[0]

    stock = build("llama", torch.float32)
    original = modeling.LlamaRMSNorm
    modeling.LlamaRMSNorm = NPURMSNorm
    try:
        replaced = build("llama", torch.float32)
    finally:
        modeling.LlamaRMSNorm = original
    assert sum(isinstance(m, NPURMSNorm) for m in replaced.modules()) == 5
    replaced.load_state_dict(stock.state_dict())
    x = tokens()
    loss = replaced(x, labels=x).loss
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in replaced.parameters())
    with torch.no_grad():
        want = stock(x).logits
        rel = ((replaced(x).logits - want).abs().max() / want.abs().max()).item()
    assert rel <= 1e-5, rel


def test_blocks_run_on_torchs_openmp_pool():
    """at::parallel_for is a header template: built without -fopenmp its
    loop is serial, and every op ran on one thread whatever
    torch.set_num_threads said (seen: 1.0 CPU-seconds per wall second on
    two threads). The extension must call into OpenMP when torch does."""
    import torch

    import npukern_torch

    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch is not built with OpenMP here")
    with open(npukern_torch._C.__file__, "rb") as f:
        assert b"GOMP_parallel" in f.read()
