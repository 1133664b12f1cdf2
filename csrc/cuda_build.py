"""Build description of torch_afdep's CUDA extension (``torch_afdep._cuda``).

Plain CUDA runtime + pybind11: no torch CUDA headers or libraries, so it compiles beside a
CPU-only torch too. setup.py calls ``make_cuda_extension(root, cuda_home)`` and builds the
result with torch's BuildExtension (ninja), which compiles the ``.cu`` sources with nvcc.

Environment:
    AFDEP_NCCL=0, AFDEP_NCCL_HOME   see ``find_nccl`` (the optional NCCL transport)
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
    "csrc/core/transport_nccl.cu",
    "csrc/kernels/dispatch.cu",
    "csrc/kernels/combine.cu",
    "csrc/kernels/probe.cu",
]


def find_nccl():
    """(include dir, lib dir) of the NCCL to build the NCCL transport against, or None.

    ``AFDEP_NCCL_HOME`` (a folder with include/nccl_device.h and lib/libnccl.so.2) wins;
    else the nvidia-nccl-cu13 wheel beside torch (what torch loads at run time). The system's
    /usr/include/nccl.h is never used: its version rarely matches the library torch loads.
    ``AFDEP_NCCL=0`` builds without the NCCL transport."""
    import importlib.util

    if os.environ.get("AFDEP_NCCL", "1") == "0":
        return None
    roots = []
    if os.environ.get("AFDEP_NCCL_HOME"):
        roots.append(os.environ["AFDEP_NCCL_HOME"])
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
        roots += list(spec.submodule_search_locations or []) if spec else []
    except ImportError:  # no "nvidia" namespace package installed
        pass
    for r in roots:
        inc, lib = os.path.join(r, "include"), os.path.join(r, "lib")
        if os.path.exists(os.path.join(inc, "nccl_device.h")) and os.path.exists(
                os.path.join(lib, "libnccl.so.2")):
            return inc, lib
    return None


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
    link = []
    nccl = find_nccl()
    if nccl:  # the NCCL headers first: /usr/include may hold another NCCL's nccl.h
        inc.insert(0, nccl[0])
        common.append("-DAFDEP_WITH_NCCL")
        libdirs.append(nccl[1])
        link = ["-l:libnccl.so.2"]
    return Extension(
        name="torch_afdep._cuda",
        sources=SOURCES,  # relative to setup.py's directory, as setuptools expects
        include_dirs=inc,
        library_dirs=libdirs,
        libraries=["cudart"],
        runtime_library_dirs=libdirs,
        extra_link_args=link,
        language="c++",
        extra_compile_args={
            "cxx": common + ["-fvisibility=hidden"],
            "nvcc": common + arch_flags() + ["-lineinfo", "--expt-relaxed-constexpr",
                                             "-Xptxas=-v" if os.environ.get("AFDEP_PTXAS_V") else "-DAFDEP_QUIET"],
        },
    )
