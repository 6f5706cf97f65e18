"""Builds npukern_torch: a C++ extension on npukern's C ABI.

The extension compiles against ``include/npukern.h`` and links the static
library ``target/release/libnpukern.a`` of the repository this directory sits
in (``NPUKERN_ROOT`` overrides where that is); when the library is missing,
``cargo build --release`` is run at that root first. Install with
``pip install --no-build-isolation ./adapters/torch`` into an environment
that has torch.
"""

import os
import subprocess
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = Path(__file__).resolve().parent
ROOT = Path(os.environ.get("NPUKERN_ROOT", HERE.parent.parent)).resolve()
INCLUDE = ROOT / "include"
STATIC_LIB = ROOT / "target" / "release" / "libnpukern.a"
SOURCES = ["glue.cpp", "norm_ops.cpp", "embedding_ops.cpp", "grad_ops.cpp", "elementwise_ops.cpp", "register.cpp"]


def static_library() -> Path:
    if not STATIC_LIB.exists():
        subprocess.run(["cargo", "build", "--release"], cwd=ROOT, check=True)
    if not STATIC_LIB.exists():
        raise RuntimeError(f"cargo build --release did not produce {STATIC_LIB}")
    return STATIC_LIB


# Sources are passed relative to this directory (setuptools requires it).
setup(
    ext_modules=[
        CppExtension(
            name="npukern_torch._C",
            sources=[f"csrc/{s}" for s in SOURCES],
            include_dirs=[str(INCLUDE)],
            extra_compile_args=["-O2", "-Wall", "-Wextra"],
            # The Rust standard library inside the static library needs these
            # system libraries; --exclude-libs keeps its symbols private.
            extra_link_args=[
                str(static_library()),
                "-Wl,--exclude-libs,libnpukern.a",
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
    cmdclass={"build_ext": BuildExtension},
)
