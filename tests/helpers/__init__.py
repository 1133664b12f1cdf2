"""Test helpers, by what they hold:

- ``devices``: the ``device`` parameter of the contract suite, GPU skip rules, spawning a
  world on CPU or on GPUs (ranks on ``r % n_gpus``; shared GPUs need CUDA MPS).
- ``checks``: test expert functions and the checks of what an FFN rank received and what an
  Attention rank got back, against ``torch_afdep.reference``.
- ``exchange_bodies``: spawned-world bodies of the exchange, slot and zero-copy contract.
- ``op_bodies``: bodies of the op, compile, bad-input and registry tests.
- ``lifecycle_bodies``: the parts of the lifecycle and CPU fault worlds.
- ``nn_bodies`` / ``vllm_bodies``: ``torch_afdep.nn`` and the vLLM connector worlds.
- ``transport_bodies``: GPU bodies that drive ``CudaTransport`` directly (transport tests).
- ``hostile``: hostile device inputs, their exact model, the hostile graph-replay body.
- ``graph_bodies``: CUDA-graph bodies through the public API (Buffer, afd_*, AfdMoE).

Spawned ranks inherit sys.path, so they import these modules by name (spawn pickles the
body functions by module and name).
"""
