"""Alias of :mod:`torch_afdep.tools.demo`: ``python -m torch_afdep.demo`` runs it, and
``import torch_afdep.demo`` gives that module itself."""

import sys

from .tools import demo as _demo

if __name__ == "__main__":  # python -m torch_afdep.demo
    sys.exit(_demo.main())
sys.modules[__name__] = _demo
