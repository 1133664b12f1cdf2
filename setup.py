"""Build torch_afdep: the c10d backend (`torch_afdep._C`) and, where nvcc exists, the CUDA
transport and kernels (`torch_afdep._cuda`).

Build-time environment (documented, with every other AFDEP_* variable, in torch_afdep/env.py,
which this file loads by path so that building never imports the package):
    AFDEP_BUILD_CUDA=auto/0/1   the CUDA extension: on when nvcc is found / off / on
    AFDEP_CUDA_ARCH, AFDEP_NCCL, AFDEP_NCCL_HOME, AFDEP_PTXAS_V   see csrc/cuda_build.py
"""

import os
import shutil
import sys

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(ROOT, "csrc"))
import cuda_build  # noqa: E402  (csrc/cuda_build.py: stdlib only at import)

ENV = cuda_build.load_env()


#: What the package needs at run time (any torch from 2.11: engines such as vLLM pin their
#: own). Exact versions for tests and CI live in requirements.txt only.
INSTALL_REQUIRES = ["torch>=2.11"]


def backend_extension():
    """The c10d backend: a C++ c10d::Backend that knows roles and delegates collectives."""
    return CppExtension(name="torch_afdep._C", **cuda_build.backend_extension_args(ROOT))


def _find_cuda_home():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    return None


def cuda_extension():
    """The CUDA transport and kernels. Plain CUDA runtime + pybind11: no torch CUDA headers,
    so it also builds beside a CPU-only torch (CI compiles it that way)."""
    want = ENV.get("AFDEP_BUILD_CUDA")
    cuda_home = _find_cuda_home()
    if want == "0" or (want == "auto" and cuda_home is None):
        return None
    if cuda_home is None:
        raise RuntimeError("AFDEP_BUILD_CUDA=1 but nvcc was not found (set CUDA_HOME)")
    return cuda_build.make_cuda_extension(ROOT, cuda_home)


ext_modules = [backend_extension()]
_cuda_ext = cuda_extension()
if _cuda_ext is not None:
    ext_modules.append(_cuda_ext)

setup(
    name="torch_afdep",
    version="0.1.0",
    description="Attention-FFN disaggregated MoE communication for PyTorch",
    packages=find_packages(include=["torch_afdep", "torch_afdep.*"]),
    python_requires=">=3.10",
    install_requires=INSTALL_REQUIRES,
    extras_require={"test": ["pytest", "expecttest", "numpy"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    zip_safe=False,
)
