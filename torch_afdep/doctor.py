"""Alias of :mod:`torch_afdep.tools.doctor` (``import torch_afdep.doctor`` gives that module
itself, so patching an attribute here patches the doctor)."""

import sys

from .tools import doctor as _doctor

if __name__ == "__main__":  # python -m torch_afdep.doctor
    sys.exit(_doctor.main())
sys.modules[__name__] = _doctor
