"""The public Buffer API on CUDA (torch_afdep.Buffer selects CudaTransport on a CUDA device).

Skipped cleanly without two CUDA GPUs or without the built extension."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


import gpu_worlds as gw  # noqa: E402  (tests/gpu is on sys.path under pytest)

gw.skip_unless_two_gpus()



ENV = gw.GPU_ENV


@pytest.mark.parametrize("layout,devs,F,A,dtype", [
    ("1A1F", [0, 1], 1, 1, "bfloat16"),
    ("2A2F", [0, 1, 0, 1], 2, 2, "float8_e4m3fn"),
])
def test_buffer_api_cuda(layout, devs, F, A, dtype):
    kw = dict(capacity_tokens_per_rank=128, hidden_size=2048, num_experts=128, top_k=8,
              ffn_ranks=F, attention_ranks=A, dtype=dtype, num_sms=24, timeout_s=10.0)
    plan = [(128, [7, 128][:A], "random"), (16, [0, 16][:A], "partial"),
            (128, [128, 1][:A], "skewed")]
    res = gw.spawn_gpu_world(gw.buffer_body, F + A, kw, plan, 77, device_ids=devs, env=ENV,
                      timeout=300)
    assert all(r == len(plan) for r in res)
