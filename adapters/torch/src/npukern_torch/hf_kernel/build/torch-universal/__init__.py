"""npukern's layers as a local `kernels` repository (see npukern_torch.hf.KERNEL_REPO)."""

from npukern_torch import hf_layers as layers  # noqa: F401
