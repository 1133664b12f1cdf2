"""GPU-only tests: the CUDA transport, CUDA graphs, hostile device inputs in graph replays,
memcheck, the NCCL transport, the trace tool."""
