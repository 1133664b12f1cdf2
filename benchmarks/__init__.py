"""Benchmarks of torch_afdep: ``python -m benchmarks.run --help`` (see benchmarks/README.md)."""
