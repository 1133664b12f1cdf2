"""README's "The API in 20 lines", runnable: the block between the two marker comments below
is the README's code block, character for character (tests/tools/test_readme_api.py checks).

    python examples/readme_api.py [--allow-shared-gpu]    # launches its 4 ranks itself
    torchrun --nproc-per-node 4 examples/readme_api.py     # or any launcher that sets RANK

Four ranks, roles FFAA (2 FFN ranks hold the experts, 2 Attention ranks route tokens), over
``"cpu:gloo,cuda:afdep"`` (CPU tensors over gloo; CUDA tensors over NVLink when GPUs and the
CUDA extension are present). Each Attention rank runs one exchange with the Buffer role API
and one with the functional form; each FFN rank answers both, once with ``worker_receive`` /
``worker_reply`` and once with ``afd_receive`` / ``afd_reply``. Both outputs are checked
against ``torch_afdep.reference.moe_output``, the same layer in float64 in one process; a
mismatch fails the rank.
"""

import os
import sys

TOLERANCE = 1e-2  # bf16 rows summed in fp32

if __name__ == "__main__" and "RANK" not in os.environ:  # no rank yet: launch 4 of them
    import subprocess

    # In a fresh interpreter (torch_afdep.tools.launch, spawn_world underneath): spawned
    # children re-import their parent's main script, and this one's top level is the ranks'.
    sys.exit(subprocess.call([sys.executable, "-m", "torch_afdep.tools.launch", "--nproc", "4",
                              *sys.argv[1:], __file__]))

# ---- README "The API in 20 lines": begin ----
import torch, torch.distributed as dist, torch_afdep
from torch_afdep import Buffer, Config
from torch_afdep.distributed import AfdepOptions
from torch_afdep.reference import make_inputs

dist.init_process_group("cpu:gloo,cuda:afdep", pg_options=AfdepOptions(roles="FFAA"))
if torch.cuda.is_available():                         # one GPU per rank (Buffer's device)
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
group = dist.group.WORLD                              # ranks 0, 1: FFN; 2, 3: Attention
cfg = Config(capacity_tokens_per_rank=64, hidden_size=256, num_experts=8, top_k=2,
             ffn_ranks=2, attention_ranks=2, roles="FFAA")  # the same on every rank

def my_experts(rec, first):  # stand-in experts: global expert e multiplies its rows by e + 1
    rows = torch.zeros(rec.x.shape, dtype=torch.float32, device=rec.x.device)
    offs = rec.expert_offsets.tolist()                # host copy: fine for a sketch
    for e in range(cfg.experts_per_rank):             # rows of local expert e: offs[e]:offs[e+1]
        lo, hi = offs[e], offs[e + 1]
        rows[lo:hi] = rec.x[lo:hi].float() * (first + e + 1) * rec.weights[lo:hi, None]
    return rows.bfloat16()                            # [A*bucket*R, H], routing weights applied

with Buffer(group, cfg) as buf:                       # collective; allocates everything
    if buf.role == "attention":                       # Attention: send tokens, get their sums
        x, expert_ids, weights, _ = make_inputs(cfg, 48, a=buf.role_index, device=buf.device)
        buf.source_dispatch(x, expert_ids, weights, bucket=64)  # x [T,H] bf16, ids/weights [T,k]
        out = buf.source_collect()                    # [T,H] bf16: sum of the experts' rows
        # Functional form, traceable by torch.compile(fullgraph=True), CUDA-graph capturable:
        route = torch_afdep.afd_dispatch(x, expert_ids, weights, group=group, bucket=64)
        out_fn = torch_afdep.afd_combine(route, group=group)  # torch.ops.afdep.dispatch/combine
    else:                                             # FFN: rows grouped by local expert
        first = buf.role_index * cfg.experts_per_rank  # this FFN rank's first global expert
        rec = buf.worker_receive(bucket=64)
        buf.worker_reply(my_experts(rec, first), rec.receipt)
        rec = torch_afdep.afd_receive(group=group, bucket=64)  # torch.ops.afdep.receive/reply
        torch_afdep.afd_reply(my_experts(rec, first), rec.receipt, group=group)
# ---- README "The API in 20 lines": end ----

# Everything below checks the block's results against the fp64 reference.
from torch_afdep import reference  # noqa: E402

if buf.role == "attention":
    want = reference.moe_output(cfg, x.cpu(), expert_ids.cpu(), weights.cpu(),
                                lambda e, rows: rows * (e + 1))
    errors = [reference.relative_error(out, want), reference.relative_error(out_fn, want)]
    RESULT = {"role": "attention", "tokens": int(x.shape[0]), "errors": errors}
    line = (f"attention {buf.role_index}: {x.shape[0]} tokens, relative error against the "
            f"fp64 reference: Buffer API {errors[0]:.2e}, functional {errors[1]:.2e}")
    if max(errors) >= TOLERANCE:
        raise AssertionError(f"{line} (tolerance {TOLERANCE})")
else:
    RESULT = {"role": "ffn", "rows": int(rec.expert_offsets[-1])}
    line = f"ffn {buf.role_index}: {RESULT['rows']} expert rows in the last exchange"
print(f"rank {dist.get_rank()}: {line}", flush=True)
