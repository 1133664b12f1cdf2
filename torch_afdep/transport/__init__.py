"""Transports: ``base.Transport`` (the interface), ``cpu.CpuTransport`` (gloo),
``cuda.CudaTransport`` (CUDA peer memory; imports the extension on first use)."""

from .base import Transport, make_transport

__all__ = ["Transport", "make_transport"]
