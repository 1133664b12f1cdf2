"""Command-line tools that ship with torch_afdep (each runs as ``python -m``).

- ``torch_afdep.tools.doctor``: ``python -m torch_afdep doctor``: versions, compiled parts,
  GPUs, peer access and MPS, the environment, and a self-test exchange.
- ``torch_afdep.tools.demo``: ``python -m torch_afdep.demo``: the main job, a small AFD MoE
  layer through the exchange, checked against a single-process fp64 layer.
- ``torch_afdep.tools.launch``: ``python -m torch_afdep.tools.launch --nproc N script.py``: a
  script that initializes its own process group, run on N local ranks as under torchrun
  (``examples/readme_api.py`` uses it).
- ``torch_afdep.tools.cli``: the argument helpers the demo and ``examples/`` share (layouts
  as ``2A2F``, roles as ``FFAA``, config errors as argparse errors, GPU placement checks).

``torch_afdep.doctor`` and ``torch_afdep.demo`` are aliases of the first two.
"""
