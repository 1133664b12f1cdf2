"""Build torch_afdep._cuda (and, with WITH_BACKEND=1, the c10d backend torch_afdep._C) in place
in the current directory's tree, without pip: the device machines' quick build
(scripts/gpu_suite.sh BUILD=cuda-only, scripts/gpu_ab_builds.sh). Run from the root of the
tree to build; the tree's own csrc/cuda_build.py describes its extensions, so an older tree
(an A/B baseline) builds as it did at its commit. MAX_JOBS caps ninja's parallel compiles.

Usage: (cd TREE && python3 /path/to/scripts/build_inplace.py)
"""

import os
import sys

root = os.getcwd()
sys.path.insert(0, os.path.join(root, "csrc"))
from cuda_build import backend_extension_args, make_cuda_extension  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension  # noqa: E402

exts = [make_cuda_extension(root, None)]
if os.environ.get("WITH_BACKEND") == "1":  # the c10d backend too (the gpu-marked tests need it)
    exts.append(CppExtension("torch_afdep._C", **backend_extension_args(root)))
setup(name="torch_afdep_cuda_only", ext_modules=exts,
      cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
      script_args=["build_ext", "--inplace"])
