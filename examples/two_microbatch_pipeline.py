"""Two micro-batches in flight: attention of one overlaps the experts of the other.

    python examples/two_microbatch_pipeline.py [--layout 1A1F | --roles FA] [--layers 4]
                                               [--tokens 16]
                                               [--attention-ms 20] [--expert-ms 20] [--steps 3]

Each Attention rank splits its batch into two micro-batches and runs an L-layer MoE model
whose attention and expert stages are synthetic (a small real computation plus a sleep of
``--attention-ms`` / ``--expert-ms`` per micro-batch and layer, so the timing shows the
schedule rather than how many CPU cores the machine has). Two schedules on one ``Buffer``:

- serial (1 slot): attention(ub) -> dispatch -> collect -> next micro-batch; the Attention
  rank idles while the FFN rank computes, and the other way round.
- pipelined (2 slots, the FastAFD / vLLM DBO ping-pong): micro-batch 0 is dispatched on slot
  0 and, while the FFN rank computes its experts, the Attention rank computes micro-batch 1's
  attention and dispatches it on slot 1; then it collects slot 0, computes the next layer's
  attention of micro-batch 0, dispatches it, collects slot 1, and so on.

Printed: the step time of each schedule against the sum of its parts (attention + experts +
exchange), and the relative error of every layer's MoE output against the fp64 single-process
layer. On CPU (gloo) the numbers are illustrative: the exchange itself costs milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import torch_afdep
from torch_afdep.nn import SwiGLUExperts, reference_moe, topk_route
from torch_afdep.testing import spawn_world
from torch_afdep.tools import cli, demo

HIDDEN, INTER, EXPERTS, TOP_K = 128, 64, 8, 2
#: Results of the last main() call (tests read them).
LAST: dict = {}


def layer_weights(layer: int):
    """(attn, router, w1, w3, w2) of one layer: see torch_afdep.demo.synthetic_layer."""
    return demo.synthetic_layer(900 + layer, HIDDEN, INTER, EXPERTS)


def batch(a: int, step: int, tokens: int):
    """Two micro-batches of one Attention rank's batch (sizes differ when tokens is odd)."""
    g = torch.Generator().manual_seed(31 * step + a)
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16().float()
    half = (tokens + 1) // 2
    return [x[:half], x[half:]]


class AttentionRank:
    def __init__(self, buf, layers, attention_ms):
        self.buf, self.layers, self.ms = buf, layers, attention_ms
        self.weights = [layer_weights(l) for l in range(layers)]
        self.attention_s = 0.0
        self.errors = []
        self.pending = {}

    def attention(self, layer, h):
        t0 = time.perf_counter()
        attn = self.weights[layer][0]
        out = (h + 0.5 * torch.tanh(h @ attn.T)).bfloat16().float()
        time.sleep(self.ms / 1000)  # stands in for KV-cache reads and projections
        self.attention_s += time.perf_counter() - t0
        return out

    def dispatch(self, layer, ub, h, slot):
        router = self.weights[layer][1]
        ids, w = topk_route(h, router, TOP_K)
        bucket = self.buf.config.capacity_tokens_per_rank
        self.buf.source_dispatch(h.bfloat16(), ids, w, bucket=bucket, slot=slot)
        self.pending[ub] = (layer, h, ids, w)

    def collect(self, ub, slot, check):
        layer, h, ids, w = self.pending.pop(ub)
        out = self.buf.source_collect(slot=slot)
        if check:
            _, _, w1, w3, w2 = self.weights[layer]
            want = reference_moe(h, ids, w, w1, w3, w2)
            err = (out.double() - want).norm() / want.norm().clamp(min=1e-30)
            self.errors.append(float(err))
        return h + out.float()

    def serial(self, mbs, check):
        for layer in range(self.layers):
            for ub in range(2):
                mbs[ub] = self.attention(layer, mbs[ub])
                self.dispatch(layer, ub, mbs[ub], slot=0)
                mbs[ub] = self.collect(ub, 0, check)
        return mbs

    def pipelined(self, mbs, check):
        for ub in range(2):
            mbs[ub] = self.attention(0, mbs[ub])
            self.dispatch(0, ub, mbs[ub], slot=ub)
        for layer in range(self.layers):
            for ub in range(2):
                mbs[ub] = self.collect(ub, ub, check)
                if layer + 1 < self.layers:
                    mbs[ub] = self.attention(layer + 1, mbs[ub])
                    self.dispatch(layer + 1, ub, mbs[ub], slot=ub)
        return mbs


class FfnRank:
    def __init__(self, buf, layers, expert_ms):
        self.buf, self.layers, self.ms = buf, layers, expert_ms
        el, f = buf.config.experts_per_rank, buf.role_index
        self.experts = []
        for l in range(layers):
            ex = SwiGLUExperts(el, HIDDEN, INTER, dtype=torch.float32)
            _, _, w1, w3, w2 = layer_weights(l)
            ex.load(*(t[f * el:(f + 1) * el] for t in (w1, w3, w2)))
            self.experts.append(ex)
        self.expert_s = 0.0

    def serve(self, layer, slot):
        rec = self.buf.worker_receive(self.buf.config.capacity_tokens_per_rank, slot=slot)
        t0 = time.perf_counter()
        rows = self.experts[layer](rec.x, rec.weights, rec.expert_offsets)
        time.sleep(self.ms / 1000)  # stands in for the expert GEMMs of the micro-batch
        self.expert_s += time.perf_counter() - t0
        self.buf.worker_reply(rows, rec.receipt)

    def step(self, schedule):
        for layer in range(self.layers):
            for ub in range(2):
                self.serve(layer, 0 if schedule == "serial" else ub)


def rank_main(rank, world, cfg, layers, tokens, attention_ms, expert_ms, steps):
    torch.set_num_threads(1)  # several ranks share the machine's cores
    buf = torch_afdep.Buffer(None, cfg, device="cpu")
    out = {"role": buf.role, "index": buf.role_index}
    if buf.role == "attention":
        eng = AttentionRank(buf, layers, attention_ms)
    else:
        eng = FfnRank(buf, layers, expert_ms)
    for schedule in ("serial", "pipelined"):
        times, busy = [], []
        for step in range(steps + 1):  # step 0 warms up
            torch.distributed.barrier()
            if buf.role == "attention":
                eng.attention_s = 0.0
                mbs = batch(buf.role_index, step, tokens)
                t0 = time.perf_counter()
                getattr(eng, schedule)(mbs, check=True)
                times.append(time.perf_counter() - t0)
                busy.append(eng.attention_s)
            else:
                eng.expert_s = 0.0
                t0 = time.perf_counter()
                eng.step(schedule)
                times.append(time.perf_counter() - t0)
                busy.append(eng.expert_s)
        out[schedule] = {"step_s": statistics.median(times[1:]),
                         "busy_s": statistics.median(busy[1:])}
    if buf.role == "attention":
        out["errors"] = eng.errors
    buf.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_layout_arguments(p, default="1A1F")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16, help="tokens per Attention rank and step")
    p.add_argument("--attention-ms", type=float, default=20.0)
    p.add_argument("--expert-ms", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=2, help="timed steps per schedule")
    args = p.parse_args(argv)
    a, f, roles = cli.resolve_layout(p, args)
    cfg = cli.make_config(p, capacity_tokens_per_rank=(args.tokens + 1) // 2,
                          hidden_size=HIDDEN, num_experts=EXPERTS, top_k=TOP_K, ffn_ranks=f,
                          attention_ranks=a, roles=roles, num_slots=2, timeout_s=120.0)
    print(f"two micro-batches: {a}A{f}F on cpu (gloo), {args.layers} layers, "
          f"{args.tokens} tokens per Attention rank split in 2, synthetic attention "
          f"{args.attention_ms:g} ms and experts {args.expert_ms:g} ms per micro-batch and "
          f"layer", flush=True)
    results = spawn_world(rank_main, a + f, cfg, args.layers, args.tokens, args.attention_ms,
                          args.expert_ms, args.steps, timeout=600)
    attn = [r for r in results if r["role"] == "attention"]
    ffn = [r for r in results if r["role"] == "ffn"]
    worst = max(max(r["errors"]) for r in attn)
    summary = {}
    for schedule, label in (("serial", "serial (1 slot)"), ("pipelined", "pipelined (2 slots)")):
        step = max(r[schedule]["step_s"] for r in attn) * 1e3
        att = max(r[schedule]["busy_s"] for r in attn) * 1e3
        exp = max(r[schedule]["busy_s"] for r in ffn) * 1e3
        summary[schedule] = {"step_ms": step, "attention_ms": att, "expert_ms": exp}
    # The exchange's own cost: what the serial step spends beyond attention + experts.
    ser = summary["serial"]
    exchange = max(0.0, ser["step_ms"] - ser["attention_ms"] - ser["expert_ms"])
    for schedule, label in (("serial", "serial (1 slot)"), ("pipelined", "pipelined (2 slots)")):
        s = summary[schedule]
        parts = s["attention_ms"] + s["expert_ms"] + exchange
        s["parts_ms"] = parts
        print(f"  {label:20s}: step {s['step_ms']:7.1f} ms vs the sum of its parts "
              f"{parts:7.1f} ms (attention {s['attention_ms']:.1f} + experts "
              f"{s['expert_ms']:.1f} + exchange {exchange:.1f}); "
              f"{100 * (1 - s['step_ms'] / parts):+.0f}% hidden by overlap")
    speedup = summary["serial"]["step_ms"] / summary["pipelined"]["step_ms"]
    print(f"  pipelined step is {speedup:.2f}x faster than serial")
    ok = worst < 2e-2
    print(f"{'PASS' if ok else 'FAIL'}: max relative error {worst:.2e} of every layer's MoE "
          f"output against the fp64 single-process layer (both schedules)")
    LAST.clear()
    LAST.update(summary=summary, worst=worst, speedup=speedup)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
