"""Tests of what ships around the exchange: the doctor, the demo, the launcher and MPS check
(``torch_afdep.tools``, ``torch_afdep.mps``), the examples, README's API block and the vLLM
connector."""
