"""Build description of torch_afdep's extensions, shared by setup.py and the in-place
fallback build of scripts/gpu_suite.sh.

``torch_afdep._C`` (the c10d backend) is an ordinary torch CppExtension:
``backend_extension_args(root)``. ``torch_afdep._cuda`` is plain CUDA runtime + pybind11: no
torch CUDA headers or libraries, so it compiles beside a CPU-only torch too;
``make_cuda_extension(root, cuda_home)`` returns it for torch's BuildExtension (ninja), which
compiles the ``.cu`` sources with nvcc.

Build-time variables are read through torch_afdep/env.py (``load_env``), which documents them:
    AFDEP_NCCL=0, AFDEP_NCCL_HOME   see ``find_nccl`` (the optional NCCL transport)
    AFDEP_CUDA_ARCH   nvcc target flags, e.g. "-gencode=arch=compute_90a,code=sm_90a" (the
                      default) or a ';'/space separated list of such flags.
    AFDEP_PTXAS_V=1   ptxas prints register and spill counts.

Importing this file needs only the standard library (torch and pybind11 are imported when an
extension is described).
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_ARCH = "-gencode=arch=compute_90a,code=sm_90a"

#: torch_afdep._C: the c10d backend class and its pybind module.
BACKEND_SOURCES = [
    "csrc/c10d/backend.cpp",
    "csrc/bindings/c10d_module.cpp",
]

#: torch_afdep._cuda: host side (csrc/host), kernels (csrc/kernels) and its pybind module.
SOURCES = [
    "csrc/bindings/cuda_module.cpp",
    "csrc/host/comm.cpp",
    "csrc/host/transport_ipc.cpp",
    "csrc/host/transport_nccl.cu",
    "csrc/kernels/dispatch.cu",
    "csrc/kernels/combine.cu",
    "csrc/kernels/probe.cu",
]

#: The repository root (this file is csrc/cuda_build.py).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ENV = None


def load_env():
    """torch_afdep/env.py, the registry of every AFDEP_* variable, loaded by path: building
    must not import the torch_afdep package (it needs the extensions being built)."""
    global _ENV
    if _ENV is None:
        path = os.path.join(ROOT, "torch_afdep", "env.py")
        spec = importlib.util.spec_from_file_location("_torch_afdep_build_env", path)
        _ENV = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_ENV)
    return _ENV


def backend_extension_args(root: str) -> dict:
    """Keyword arguments of torch's CppExtension for ``torch_afdep._C``."""
    return {
        "sources": BACKEND_SOURCES,  # relative to setup.py's directory, as setuptools expects
        "include_dirs": [os.path.join(root, "csrc")],
        "extra_compile_args": {"cxx": ["-O2", "-std=c++17"]},
    }


def find_nccl():
    """(include dir, lib dir) of the NCCL to build the NCCL transport against, or None.

    ``AFDEP_NCCL_HOME`` (a folder with include/nccl_device.h and lib/libnccl.so.2) wins;
    else the nvidia-nccl-cu13 wheel beside torch (what torch loads at run time). The system's
    /usr/include/nccl.h is never used: its version rarely matches the library torch loads.
    ``AFDEP_NCCL=0`` builds without the NCCL transport."""
    if not load_env().get("AFDEP_NCCL"):
        return None
    roots = []
    if load_env().get("AFDEP_NCCL_HOME"):
        roots.append(load_env().get("AFDEP_NCCL_HOME"))
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
    spec = load_env().get("AFDEP_CUDA_ARCH") or DEFAULT_ARCH
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
        os.path.join(root, "csrc", "include"),
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
    ptxas = "-Xptxas=-v" if load_env().get("AFDEP_PTXAS_V") else "-DAFDEP_QUIET"
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
            "nvcc": common + arch_flags() + ["-lineinfo", "--expt-relaxed-constexpr", ptxas],
        },
    )
