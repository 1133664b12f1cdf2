"""torch_afdep: Attention-FFN disaggregated MoE communication for PyTorch."""
