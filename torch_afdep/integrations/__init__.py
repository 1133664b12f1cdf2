"""Adapters that plug torch_afdep into inference engines.

- ``torch_afdep.integrations.vllm``: an AFD connector for vLLM's AFD plugin
  (``AfdepConnector``; ``register_with_vllm()`` registers it with the plugin's factory).
  Importing it does not import vLLM.
"""
