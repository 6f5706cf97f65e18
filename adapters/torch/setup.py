"""Builds npukern_torch: a C++ extension on npukern's C ABI.

The extension compiles against ``include/npukern.h`` and links the static
library ``libnpukern.a`` of the repository this directory sits in
(``NPUKERN_ROOT`` overrides where that is). ``cargo build --release`` runs
at that root on every build (a no-op when the library is fresh), and the
library is taken from the target directory cargo itself reports
(``CARGO_TARGET_DIR`` and ``.cargo/config.toml`` included), so a stale copy
is never linked. The C++ objects are built in a directory of their own per
torch build (version and install path) and the extension is relinked on
every build: objects or a library built against another torch are never
used. Install with ``pip install --no-build-isolation
./adapters/torch`` into an environment that has torch.
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("NPUKERN_ROOT", HERE.parent.parent)).resolve()
INCLUDE = ROOT / "include"
SOURCES = ["glue.cpp", "norm_ops.cpp", "embedding_ops.cpp", "grad_ops.cpp", "elementwise_ops.cpp", "loss_ops.cpp",
           "autograd.cpp", "fast_call.cpp", "optim_ops.cpp", "matmul_ops.cpp", "attention_ops.cpp",
           "register.cpp"]


def static_library() -> Path:
    """Builds the C libraries (cargo decides whether anything is stale) and
    returns the static one from cargo's own target directory."""
    subprocess.run(["cargo", "build", "--release"], cwd=ROOT, check=True)
    meta = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=ROOT, check=True,
                          capture_output=True, text=True)
    lib = Path(json.loads(meta.stdout)["target_directory"]) / "release" / "libnpukern.a"
    if not lib.exists():
        raise RuntimeError(f"cargo build --release did not produce {lib}")
    return lib


# torch's BuildExtension finds ninja on PATH only; the environment's own
# (`pip install ninja`) is not there unless the environment is activated,
# and without ninja torch compiles every source again, one at a time.
_BIN = Path(sys.executable).parent
if (_BIN / "ninja").exists():
    os.environ["PATH"] = f"{_BIN}{os.pathsep}{os.environ.get('PATH', '')}"

STATIC_LIB = static_library()
# One object directory per torch build: its version, where it is installed.
TORCH_TAG = hashlib.sha256(f"{torch.__version__}|{Path(torch.__file__).resolve()}".encode()).hexdigest()[:12]


class Build(BuildExtension):
    """BuildExtension with the object directory keyed to the torch it builds against."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(self.build_temp, f"torch-{torch.__version__}-{TORCH_TAG}")
        # Always link: setuptools would otherwise keep the extension in
        # build/lib when it is newer than the sources, even one linked
        # against another torch. ninja still skips this torch's fresh objects.
        self.force = True


# Sources are passed relative to this directory (setuptools requires it).
setup(
    ext_modules=[
        CppExtension(
            name="npukern_torch._C",
            sources=[f"csrc/{s}" for s in SOURCES],
            include_dirs=[str(INCLUDE)],
            # -fopenmp: at::parallel_for is a header template whose OpenMP
            # loop compiles to a serial one without it (the blocks then ran on
            # one thread whatever torch.set_num_threads said); libgomp.so.1
            # is the one torch has already loaded.
            # -g0: Python's own CFLAGS ask for debug information, which for
            # torch's headers made the compile slower and the module 35 MB.
            extra_compile_args=["-O2", "-g0", "-Wall", "-Wextra", "-fopenmp"],
            # The Rust standard library inside the static library needs these
            # system libraries; --exclude-libs keeps its symbols private.
            extra_link_args=[
                str(STATIC_LIB),
                "-Wl,--exclude-libs,libnpukern.a",
                "-fopenmp",
                "-lgcc_s",
                "-lutil",
                "-lrt",
                "-lpthread",
                "-lm",
                "-ldl",
            ],
            depends=[str(INCLUDE / "npukern.h"), str(STATIC_LIB), "csrc/glue.h", "csrc/ops.h"],
        )
    ],
    cmdclass={"build_ext": Build},
)
