"""Build description of torch_afdep's CUDA extension (``torch_afdep._cuda``).

Plain CUDA runtime + pybind11: no torch CUDA headers or libraries, so it compiles beside a
CPU-only torch too. setup.py calls ``make_cuda_extension(root, cuda_home)`` and builds the
result with torch's BuildExtension (ninja), which compiles the ``.cu`` sources with nvcc.

Environment:
    AFDEP_CUDA_ARCH   nvcc target flags, e.g. "-gencode=arch=compute_90a,code=sm_90a" (the
                      default) or a ';'/space separated list of such flags.
"""

from __future__ import annotations

import os

DEFAULT_ARCH = "-gencode=arch=compute_90a,code=sm_90a"

SOURCES = [
    "csrc/bindings/cuda_module.cpp",
    "csrc/core/comm.cpp",
    "csrc/core/transport_ipc.cpp",
    "csrc/kernels/dispatch.cu",
    "csrc/kernels/combine.cu",
]


def arch_flags() -> list:
    spec = os.environ.get("AFDEP_CUDA_ARCH", DEFAULT_ARCH)
    return [f for f in spec.replace(";", " ").split() if f]


def resolve_cuda_home(cuda_home) -> str:
    """A CUDA root that really holds nvcc and the runtime headers (``nvcc`` on PATH may be a
    wrapper script outside the toolkit)."""
    import glob

    cands = [cuda_home, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             "/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for c in cands:
        if c and os.path.exists(os.path.join(c, "bin", "nvcc")) and os.path.exists(
                os.path.join(c, "include", "cuda_runtime.h")):
            return c
    raise RuntimeError(f"no CUDA toolkit with include/cuda_runtime.h found (tried {cands})")


def make_cuda_extension(root: str, cuda_home: str):
    import pybind11
    from setuptools import Extension

    cuda_home = resolve_cuda_home(cuda_home)
    # torch's BuildExtension compiles .cu files with $CUDA_HOME/bin/nvcc; a CPU-only torch
    # leaves its CUDA_HOME unset, so point it at the toolkit we build against.
    import torch.utils.cpp_extension as cpp_ext

    if not cpp_ext.CUDA_HOME or not os.path.exists(os.path.join(cpp_ext.CUDA_HOME, "bin", "nvcc")):
        cpp_ext.CUDA_HOME = cuda_home

    inc = [
        os.path.join(root, "csrc"),
        pybind11.get_include(),
        os.path.join(cuda_home, "include"),
    ]
    libdirs = [d for d in (os.path.join(cuda_home, "lib64"), os.path.join(cuda_home, "lib"))
               if os.path.isdir(d)]
    common = ["-O3", "-std=c++17"]
    return Extension(
        name="torch_afdep._cuda",
        sources=SOURCES,  # relative to setup.py's directory, as setuptools expects
        include_dirs=inc,
        library_dirs=libdirs,
        libraries=["cudart"],
        runtime_library_dirs=libdirs,
        language="c++",
        extra_compile_args={
            "cxx": common + ["-fvisibility=hidden"],
            "nvcc": common + arch_flags() + ["-lineinfo", "--expt-relaxed-constexpr",
                                             "-Xptxas=-v" if os.environ.get("AFDEP_PTXAS_V") else "-DAFDEP_QUIET"],
        },
    )
