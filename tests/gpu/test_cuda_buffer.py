"""The public Buffer API on CUDA (torch_afdep.Buffer selects CudaTransport on a CUDA device).

Skipped cleanly without two CUDA GPUs or without the built extension."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _ok() -> bool:
    try:
        import torch_afdep._cuda  # noqa: F401
        return torch.cuda.is_available() and torch.cuda.device_count() >= 2
    except Exception:
        return False


if not _ok():
    pytest.skip("needs 2 CUDA GPUs and the torch_afdep._cuda extension", allow_module_level=True)

import gpu_worlds as gw  # noqa: E402

from torch_afdep.testing import spawn_world  # noqa: E402

ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.parametrize("layout,devs,F,A,dtype", [
    ("1A1F", [0, 1], 1, 1, "bfloat16"),
    ("2A2F", [0, 1, 0, 1], 2, 2, "float8_e4m3fn"),
])
def test_buffer_api_cuda(layout, devs, F, A, dtype):
    kw = dict(capacity_tokens_per_rank=128, hidden_size=2048, num_experts=128, top_k=8,
              ffn_ranks=F, attention_ranks=A, dtype=dtype, num_sms=24, timeout_s=10.0)
    plan = [(128, [7, 128][:A], "random"), (16, [0, 16][:A], "partial"),
            (128, [128, 1][:A], "skewed")]
    res = spawn_world(gw.buffer_body, F + A, kw, plan, 77, device_ids=devs, env=ENV,
                      timeout=300)
    assert all(r == len(plan) for r in res)
