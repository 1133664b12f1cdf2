"""CUDA graphs through the public API (Buffer, afd_*, AfdMoE, the vLLM connector): a whole
two-micro-batch layer step in one graph per rank; a graph destroyed and recaptured (with a
different T) on one open buffer; AfdMoE eager, compiled (fullgraph, inductor) and with a
two-micro-batch step captured, and the connector's ping-pong over layers captured on both
roles, each in both receive layouts (expert-major rows; one row per token).
Every replay gets fresh inputs and is checked against the fp64 reference.

Skipped cleanly without a CUDA GPU or without the built extension; rank r runs on GPU
r % n_gpus (shared GPUs need CUDA MPS). Bodies: tests/helpers/graph_bodies.py.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


from tests.helpers import devices  # noqa: E402

devices.require_gpu_module()

from tests.helpers import graph_bodies as gb  # noqa: E402
from tests.helpers.devices import spawn_gpu_world  # noqa: E402


def _kw(F, A, num_slots, cap=128, hidden=2048, dtype="bfloat16"):
    return dict(capacity_tokens_per_rank=cap, hidden_size=hidden, num_experts=64, top_k=8,
                ffn_ranks=F, attention_ranks=A, dtype=dtype, num_sms=24, timeout_s=10.0,
                num_slots=num_slots)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_two_microbatch_layer_step_in_one_cuda_graph(dtype):
    """Attention: dispatch slot 0, dispatch slot 1, combine slot 1, combine slot 0; FFN:
    receive, experts, reply on slot 0 then slot 1 (lockstep orders under a symmetric
    protocol), all in one graph per rank, 20 checked replays."""
    tokens = {0: [128], 1: [37]}
    res = spawn_gpu_world(gb.two_microbatch_graph_body, 2, _kw(1, 1, 2, dtype=dtype), tokens,
                          20, 40, timeout=300)
    assert res == [20, 40]  # FFN: one check per replay; Attention: one per micro-batch


#: The recapture world's config (one FFN, one Attention rank).
RECAPTURE_KW = dict(capacity_tokens_per_rank=64, hidden_size=1024, num_experts=32, top_k=4,
                    ffn_ranks=1, attention_ranks=1, dtype="bfloat16", num_sms=8,
                    timeout_s=20.0)


def test_cuda_graph_destroyed_and_recaptured():
    """An exchange captured, replayed 20 times with fresh checked inputs, the graph destroyed,
    then captured again with a different T (and again), on one open buffer."""
    res = spawn_gpu_world(gb.recapture_body, 2, RECAPTURE_KW, [7, 33, 1], 20, timeout=600)
    assert res == [60, 60]


@pytest.mark.parametrize("receive_layout", ["experts", "tokens"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_afd_moe_eager_compiled_and_graph_1a1f(dtype, receive_layout):
    res = spawn_gpu_world(gb.moe_body, 2, 1, 1, 64, [64, 17], 10, dtype, receive_layout,
                          timeout=600)
    ffn, attn = res
    assert ffn["method"] == "grouped"  # bf16 grouped GEMM on sm90
    assert ffn["layout"] == attn["layout"] == receive_layout
    assert len(attn["errors"]) == 1 + 2 + 2 + 2 * 10


@pytest.mark.parametrize("receive_layout", ["experts", "tokens"])
def test_afd_moe_2a2f_graph(receive_layout):
    res = spawn_gpu_world(gb.moe_body, 4, 2, 2, 32, [32, 5], 5, "bfloat16", receive_layout,
                          timeout=600)
    assert all(r["layout"] == receive_layout for r in res)
    assert all(len(r["errors"]) == 1 + 2 + 2 + 2 * 5 for r in res if r["role"] == "attention")


@pytest.mark.parametrize("receive_layout", ["experts", "tokens"])
def test_vllm_connector_in_cuda_graphs_1a1f(receive_layout):
    res = spawn_gpu_world(gb.connector_body, 2, 1, 1, 3, [48, 16], 10, receive_layout,
                          timeout=600)
    assert res == [10, 3 * 2 * 11]
