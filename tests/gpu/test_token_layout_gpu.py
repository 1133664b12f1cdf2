"""The token-major receive layout (``Config(receive_layout="tokens")``) on the CUDA path.

Row a * rps + c * ceil(bucket / S) + j of an FFN's receive (rps = Config.rows_per_source) holds
token j of what channel c (the Attention's dispatch CTA c, which owns a contiguous block of
its tokens) of Attention index a sent there; x and x_scales are views of the receive window.

- ``test_token_layout_graphs``: 1A1F, 2A2F, 3A1F, 1A3F, BF16 and FP8: eager exchanges through
  the public Buffer API (T = 0, 1, a few, many), then one exchange per rank captured in a
  CUDA graph (Attention: dispatch + collect; FFN: receive, a device-side expert, reply) and
  replayed 100 times with fresh inputs copied into the captured tensors and poisoned outputs
  (the FFN's receive window too); every replay is checked on every rank: the Attention's
  output against the fp64 reference, the FFN's rows one by one (each routed token exactly
  once in its channel's block, its exact payload and scales, local ids in the source's
  column order, weights, src_rank / src_token; rows without a token all -1). Every fifth
  replay carries hostile expert ids (outside [-1, E)): that Attention rank reports
  AfdepRouteError, the entries are skipped and everything else stays exact.
- ``test_token_layout_controls``: each protocol control reverted alone (``AFDEP_<NAME>=0``),
  the experimental ones switched on, and ``AFDEP_SYMMETRIC=1``, eager, in one world (the
  settings are re-read per Buffer).

Sizes make every send path run: at H = 2048 BF16, 10 tokens per channel publish their counts
early (>= 32 KB, fewer than 16 tokens), 64 per channel send one flag per row (streamed), 32
per channel fuse claims and copies. Ranks sharing a GPU need CUDA MPS (AFDEP_TEST_SHARED_GPU=1).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.helpers import devices  # noqa: E402
from torch_afdep import controls  # noqa: E402

devices.require_gpu_module()

LAYOUTS = {"1A1F": (1, 1), "2A2F": (2, 2), "3A1F": (3, 1), "1A3F": (1, 3)}
CAP, HIDDEN, EXPERTS, TOP_K, SMS = 128, 2048, 12, 4, 2
REPLAYS = 100


def _config(a_n, f_n, dtype_name, cap=CAP, timeout_s=30.0, experts=EXPERTS):
    import torch_afdep as ta

    return ta.Config(capacity_tokens_per_rank=cap, hidden_size=HIDDEN, num_experts=experts,
                     top_k=TOP_K, ffn_ranks=f_n, attention_ranks=a_n,
                     dtype=getattr(torch, dtype_name), num_sms=SMS, receive_layout="tokens",
                     timeout_s=timeout_s)


def _expert(e, rows):
    return torch.tanh(rows) * (1.0 + 0.25 * ((e % 5) - 2)) + 0.01 * (e + 1)


def _hostile(ids, seed, experts):
    """Some entries outside [-1, experts) (the kernels skip and report them)."""
    g = torch.Generator().manual_seed(seed)
    t = ids.shape[0]
    if t == 0:
        return ids
    bad = [experts, experts + 3, -2, 2 ** 31 - 1 if ids.dtype == torch.int32 else -(2 ** 40)]
    ids = ids.clone()
    for q in range(min(4, t)):
        r = int(torch.randint(t, (1,), generator=g))
        ids[r, q % ids.shape[1]] = bad[q]
    return ids


def _inputs(cfg, a, tokens, seed, hostile=False):
    """Attention index a's host inputs (the same on every rank for one seed)."""
    from torch_afdep import reference as ref

    inp = ref.make_inputs(cfg, tokens, "partial" if seed % 2 else "random", seed, a,
                          device="cpu", id_dtype=torch.int32 if a % 2 else torch.int64)
    ids = inp.expert_ids.clone()
    if tokens > 2:  # duplicated ids: the repeat counts once, at its first column
        ids[1, 2] = ids[1, 0]
        ids[2, 3] = ids[2, 1]
    if hostile:
        ids = _hostile(ids, seed, cfg.num_experts)
    return ref.Inputs(inp.x, ids, inp.weights, inp.x_scales)


def _clean(ids, experts):
    ids = ids.to(torch.int64)
    return torch.where((ids >= 0) & (ids < experts), ids, torch.full_like(ids, -1))


def _want_output(cfg, inp):
    from torch_afdep import reference as ref

    return ref.moe_output(cfg, inp.x, _clean(inp.expert_ids, cfg.num_experts), inp.weights,
                          _expert, inp.x_scales)


def check_rows(cfg, f, rec, inputs, bucket):
    """Every row of FFN index f's token receive against the inputs; returns problems."""
    from torch_afdep import reference as ref

    problems = []
    rps = cfg.rows_per_source(bucket)
    # the CUDA layout: one block of ceil(bucket/S) rows per channel; the CPU transport (these
    # bodies run there for debugging) fills each source's rows from its first
    S = cfg.num_sms if rec.x.is_cuda else 1
    stride = rps // S
    n_rows, k = cfg.token_rows(bucket), cfg.top_k
    want_shapes = {"x": (n_rows, cfg.hidden_size), "expert_ids": (n_rows, k),
                   "weights": (n_rows, k), "src_rank": (n_rows,), "src_token": (n_rows,),
                   "num_tokens": (cfg.attention_ranks,)}
    for name, shape in want_shapes.items():
        if tuple(getattr(rec, name).shape) != shape:
            problems.append(f"{name} shape {tuple(getattr(rec, name).shape)} != {shape}")
    if problems:
        return problems
    ids, w = rec.expert_ids.cpu().to(torch.int64), rec.weights.cpu()
    tok, srank = rec.src_token.cpu().to(torch.int64), rec.src_rank.cpu()
    num = rec.num_tokens.cpu()
    x = rec.x.cpu().view(torch.uint8)
    xs = None if rec.x_scales is None or rec.x_scales.numel() == 0 else rec.x_scales.cpu()
    for a, inp in enumerate(inputs):
        lid = ref.local_expert_ids(_clean(inp.expert_ids, cfg.num_experts), f,
                                   cfg.experts_per_rank)
        reached = (lid >= 0).any(dim=1)
        T = inp.x.shape[0]
        chunk = (T + S - 1) // S
        total = 0
        for c in range(S):
            lo, hi = min(T, c * chunk), min(T, (c + 1) * chunk)
            want = (reached[lo:hi].nonzero().flatten() + lo)
            n = int(want.numel())
            total += n
            base = a * rps + c * stride
            got = tok[base:base + n]
            if not torch.equal(got.sort().values, want):
                problems.append(f"source {a} channel {c}: tokens {got.tolist()}, want "
                                f"{want.tolist()}")
                continue
            order = got.argsort()
            rows = base + order
            tw = got[order]
            if not bool((srank[rows] == cfg.attention_group_ranks[a]).all()):
                problems.append(f"source {a} channel {c}: src_rank {srank[rows].tolist()}")
            if not torch.equal(x[rows], inp.x[tw].view(torch.uint8)):
                problems.append(f"source {a} channel {c}: payload differs")
            if xs is not None and not torch.equal(xs[rows], inp.x_scales[tw]):
                problems.append(f"source {a} channel {c}: scales differ")
            if not torch.equal(ids[rows], lid[tw]):
                problems.append(f"source {a} channel {c}: ids {ids[rows].tolist()} != "
                                f"{lid[tw].tolist()}")
            want_w = torch.where(lid[tw] >= 0, inp.weights[tw].to(torch.float32), 0.0)
            if not torch.equal(w[rows], want_w):
                problems.append(f"source {a} channel {c}: weights differ")
            empty = slice(base + n, base + stride)
            if not (bool((ids[empty] == -1).all()) and bool((tok[empty] == -1).all())
                    and bool((srank[empty] == -1).all()) and bool((w[empty] == 0).all())):
                problems.append(f"source {a} channel {c}: rows without a token are not empty")
        if int(num[a]) != total:
            problems.append(f"source {a}: num_tokens {int(num[a])} != {total}")
    return problems


def device_expert_rows(cfg, f, rec):
    """The caller's MoE on the device: row i = sum_j w[i, j] * expert(ids[i, j], x[i]) over
    the local ids (fp32); rows without a token are NaN (the reply must not send them)."""
    xf = rec.x.to(torch.float32)
    if rec.x_scales is not None and rec.x_scales.numel():
        xf = xf * rec.x_scales.repeat_interleave(128, dim=1)[:, :cfg.hidden_size]
    ids = rec.expert_ids.to(torch.int64)
    valid = ids >= 0
    ge = ids + f * cfg.experts_per_rank
    th = torch.tanh(xf)
    out = torch.zeros_like(xf)
    for j in range(cfg.top_k):
        e = ge[:, j].to(torch.float32)
        term = th * (1.0 + 0.25 * (torch.remainder(e, 5) - 2))[:, None] + (0.01 * (e + 1))[:, None]
        out = out + torch.where(valid[:, j, None], term * rec.weights[:, j, None], 0.0)
    out = torch.where(valid.any(dim=1)[:, None], out, float("nan"))
    return out.to(torch.bfloat16)


def _check_errors(buf):
    for t in buf.transports:
        t.check_error()


def _eager_exchange(buf, cfg, inputs, bucket, out, tag):
    """One exchange through the Buffer API with the given inputs of every Attention index."""
    from torch_afdep import env as afdep_env
    from torch_afdep import reference as ref

    dev = buf.device if hasattr(buf, "device") else devices.world_device()
    if buf.role == "attention":
        inp = inputs[buf.role_index]
        delay_ms = float(afdep_env.get("AFDEP_TEST_DISPATCH_DELAY_MS"))
        if delay_ms and dev.type == "cuda":  # a late sender (stream order kept; ~2 GHz clock)
            torch.cuda._sleep(int(delay_ms * 2e6))
        buf.source_dispatch(inp.x.to(dev), inp.expert_ids.to(dev), inp.weights.to(dev), bucket,
                            None if inp.x_scales is None else inp.x_scales.to(dev))
        got = buf.source_collect()
        devices.sync(dev)
        _check_errors(buf)
        err = ref.relative_error(got, _want_output(cfg, inp))
        out["errors"].append((tag, err))
    else:
        rec = buf.worker_receive(bucket)
        devices.sync(dev)
        out["problems"] += [f"{tag}: {p}" for p in check_rows(cfg, buf.role_index, rec, inputs,
                                                               bucket)]
        out["views"].add(rec.x.data_ptr())
        buf.worker_reply(device_expert_rows(cfg, buf.role_index, rec), rec.receipt)
        devices.sync(dev)
        _check_errors(buf)


def eager_plan(cap):
    """T per Attention index (cycled) of the eager exchanges: 0, 1, a few, the bucket."""
    few = min(20, cap - 1)
    return [[0, 1, few], [cap, few, 1], [few, 0, cap], [1, cap, 0]]


def token_graph_body(rank, world, a_n, f_n, dtype_name, replays, cap=CAP, zero_copy=False,
                     graph_tokens=None, experts=EXPERTS):
    import torch.distributed as dist

    import torch_afdep as ta
    from torch_afdep import reference as ref
    from torch_afdep.errors import AfdepRouteError

    cfg = _config(a_n, f_n, dtype_name, cap, experts=experts)
    dev = devices.world_device()
    out = {"errors": [], "problems": [], "views": set(), "route_errors": 0, "replays": 0}
    bucket = cap
    with ta.Buffer(None, cfg, device=dev) as buf:
        out["flags"] = getattr(buf.transport, "flags", None)  # the controls the kernels got
        out["forms"] = [set(), set()]  # the kernel forms each phase's launches ran
        out["role"] = buf.role

        def note_forms():
            forms = getattr(buf.transport, "last_forms", None)  # the CUDA transport's
            if forms is not None:
                out["forms"][0].add(forms[0])
                out["forms"][1].add(forms[1])

        for step, tokens in enumerate(eager_plan(cap)):
            inputs = [_inputs(cfg, a, tokens[a % len(tokens)], 10 + step) for a in range(a_n)]
            _eager_exchange(buf, cfg, inputs, bucket, out, f"eager {step}")
            note_forms()
        dist.barrier()

        # one exchange per rank in a CUDA graph
        # graph_tokens: the graph's T per Attention index (cycled) instead
        cyc = graph_tokens or [cap, min(20, cap - 1), min(3, cap)]
        g_tokens = [cyc[a % len(cyc)] for a in range(a_n)]
        first = [_inputs(cfg, a, g_tokens[a], 1000) for a in range(a_n)]
        if buf.role == "attention":
            me = buf.role_index
            xs = first[me].x.to(dev)
            ids = first[me].expert_ids.to(dev)
            ws = first[me].weights.to(dev)
            scs = None if first[me].x_scales is None else first[me].x_scales.to(dev)

            # zero_copy (one FFN rank): the graph's result is the view of the combine inbox
            # that the collect writes (and the poison below overwrites before each replay)
            zc = zero_copy and f_n == 1

            def step():
                buf.source_dispatch(xs, ids, ws, bucket, scs)
                return buf.source_collect(zero_copy=zc)
        else:
            f = buf.role_index

            def step():
                rec = buf.worker_receive(bucket)
                buf.worker_reply(device_expert_rows(cfg, f, rec), rec.receipt)
                return rec

        res = step()  # warm-up on the tensors the graph captures
        devices.sync(dev)
        _check_errors(buf)
        graphs = dev.type == "cuda"  # on a CPU world (debugging): eager steps, no hostile ids
        graph = None
        if graphs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                res = step()
            note_forms()  # the forms every replay runs
        devices.sync(dev)
        dist.barrier()
        for i in range(replays):
            hostile = graphs and i % 5 == 3
            inputs = [_inputs(cfg, a, g_tokens[a], 2000 + i, hostile=hostile)
                      for a in range(a_n)]
            if buf.role == "attention":
                mine = inputs[me]
                xs.copy_(mine.x)
                ids.copy_(mine.expert_ids)
                ws.copy_(mine.weights)
                if scs is not None:
                    scs.copy_(mine.x_scales)
                res.fill_(float("nan"))
            elif graphs:  # poison every output, the receive window included (no rank sends)
                res.x.view(torch.uint8).fill_(0xFF)
                if res.x_scales is not None and res.x_scales.numel():
                    res.x_scales.fill_(float("nan"))
                res.expert_ids.fill_(-7)
                res.weights.fill_(float("nan"))
                res.src_rank.fill_(-7)
                res.src_token.fill_(-7)
                res.num_tokens.fill_(-7)
            devices.sync(dev)
            dist.barrier()  # poisoned everywhere before any rank replays
            if graphs:
                graph.replay()
            else:
                res = step()
            devices.sync(dev)
            tag = f"replay {i}"
            if buf.role == "attention":
                bad = hostile and inputs[me].x.shape[0] > 0
                try:
                    _check_errors(buf)
                    if bad:
                        out["problems"].append(f"{tag}: hostile ids not reported")
                except AfdepRouteError:
                    out["route_errors"] += 1
                    if not bad:
                        out["problems"].append(f"{tag}: unexpected AfdepRouteError")
                out["errors"].append((tag, ref.relative_error(res, _want_output(cfg, inputs[me]))))
            else:
                _check_errors(buf)
                out["problems"] += [f"{tag}: {p}" for p in check_rows(cfg, f, res, inputs,
                                                                       bucket)]
                out["views"].add(res.x.data_ptr())
            out["replays"] += 1
        del graph
        devices.sync(dev)
        dist.barrier()
    return out


# The kill worlds' bucket: ceil(4 / SMS) = 2 tokens per channel, the flagged units' size
KILL_CAP, KILL_BUCKET = 8, 4


def token_kill_body(rank, world, a_n, f_n, outdir, scenario):
    """A rank dies (os._exit) mid-exchange in the token layout, after two healthy exchanges
    through the Buffer API, in transport_bodies.kill_body's two scenarios. Each survivor
    records its wait (the waiting op's kernel ends at its deadline) and the AfdepTimeoutError
    its next op raises, then closes without its peers. Attention index a sends KILL_BUCKET
    tokens (a even) or 1 (a odd)."""
    import time
    import traceback

    import torch.distributed as dist

    import torch_afdep as ta
    from tests.helpers import transport_bodies as hb

    cfg = _config(a_n, f_n, "bfloat16", KILL_CAP, timeout_s=hb.KILL_TIMEOUT_S)
    dev = devices.world_device()
    buf = ta.Buffer(None, cfg, device=dev)
    rec = {"rank": rank, "healthy": [], "victim": False}
    hb.save_rank_record(outdir, rank, rec)
    death = os.path.join(outdir, "death")
    ffn, att = cfg.ffn_group_ranks, cfg.attention_group_ranks
    tokens = [KILL_BUCKET if a % 2 == 0 else 1 for a in range(a_n)]

    def inputs(n):
        return [_inputs(cfg, a, tokens[a], 300 + n) for a in range(a_n)]

    def exchange(n):
        """One checked exchange (raises unless exact); True."""
        out = {"errors": [], "problems": [], "views": set()}
        _eager_exchange(buf, cfg, inputs(n), KILL_BUCKET, out, f"exchange {n}")
        assert out["problems"] == [], out["problems"][:4]
        assert all(e < _tol("bfloat16") for _, e in out["errors"]), out["errors"]
        return True

    def dispatch(n):
        inp = inputs(n)[buf.role_index]
        buf.source_dispatch(inp.x.to(dev), inp.expert_ids.to(dev), inp.weights.to(dev),
                            KILL_BUCKET)

    def waited(wait_op, next_op):
        """Run the op that waits (on CUDA its kernel ends at its deadline; the CPU transport
        raises inside the op), then the next op: the error either raises, and how long after
        the wait began. ``wait_op`` returns what ``next_op`` takes."""
        t0 = time.monotonic()
        w = {"type": None}
        try:
            got = wait_op()
            devices.sync(dev)
            w["elapsed"] = time.monotonic() - t0
            next_op(got)
        except Exception as e:  # noqa: BLE001 (recorded; the test asserts the type)
            w.update(type=type(e).__name__, message=str(e), peer=getattr(e, "peer", None),
                     phase=getattr(e, "phase", None), rank=getattr(e, "rank", None))
        w.setdefault("elapsed", time.monotonic() - t0)
        if os.path.exists(death):
            with open(death) as f:
                w["after_death"] = time.time() - float(f.read())
        return w

    def receive():
        return buf.worker_receive(KILL_BUCKET)

    def reply(r):
        buf.worker_reply(device_expert_rows(cfg, buf.role_index, r), r.receipt)

    try:
        for n in range(2):
            rec["healthy"].append(exchange(n))
        dist.barrier()
        hb.save_rank_record(outdir, rank, rec)
        n = 2
        if scenario == "ffn_after_receive":
            if rank == ffn[0]:
                buf.worker_receive(KILL_BUCKET)
                devices.sync(dev)  # every Attention rank's dispatch n arrived
                rec["victim"] = True
                hb.save_rank_record(outdir, rank, rec)
                hb._touch(death)
                os._exit(1)
            if buf.role == "ffn":
                rec["exchange_n"] = exchange(n)
                hb.save_rank_record(outdir, rank, rec)
                rec["wait"] = waited(receive, reply)  # n + 1: no Attention rank sends it
            else:
                dispatch(n)
                rec["wait"] = waited(buf.source_collect, lambda _: dispatch(n + 1))
        elif scenario == "attention_before_collect":
            replied = [os.path.join(outdir, f"waiting{r}") for r in ffn]
            if rank == att[0]:
                dispatch(n)
                devices.sync(dev)
                rec["victim"] = True
                rec["saw_ffn_waiting"] = hb._wait_files(replied, cfg.timeout_s + 60.0)
                hb.save_rank_record(outdir, rank, rec)
                time.sleep(0.2)  # the FFN ranks' receive n + 1 kernels are spinning by now
                hb._touch(death)
                os._exit(1)
            if buf.role == "ffn":
                exchange(n)  # the victim's rows of n are answered before it dies
                def receive_then_say_so():  # n + 1: the victim never dispatches it
                    r = receive()
                    hb._touch(os.path.join(outdir, f"waiting{rank}"))
                    return r

                rec["wait"] = waited(receive_then_say_so, reply)
            else:
                rec["exchange_n"] = exchange(n)
                dispatch(n + 1)  # no FFN rank replies to it
                rec["wait"] = waited(buf.source_collect, lambda _: dispatch(n + 2))
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
        hb.save_rank_record(outdir, rank, rec)
        t0 = time.monotonic()
        buf.close()  # after the failure: frees without meeting its peers
        rec["close_s"] = time.monotonic() - t0
    except BaseException:
        rec["error"] = traceback.format_exc()
        hb.save_rank_record(outdir, rank, rec)
        raise
    hb.save_rank_record(outdir, rank, rec)
    return rec


def _arms():
    from torch_afdep import env

    arms = [("default", {})]
    for name, setting in env.CONTROLS.items():
        if name in ("AFDEP_LL_EXPERTS", "AFDEP_LONE_EXPAND", "AFDEP_FANOUT_EXPAND"):
            continue  # the expert layout's only
        # each control away from its default: reverted, or (experimental) switched on
        value = "0" if setting.default else "1"
        arms.append((f"{name}={value}", {name: value}))
    arms.append(("AFDEP_SYMMETRIC=1", {env.SYMMETRIC: "1"}))
    return arms


def token_controls_body(rank, world, a_n, f_n, dtype_name):
    import torch.distributed as dist

    import torch_afdep as ta
    from torch_afdep import env

    cfg = _config(a_n, f_n, dtype_name)
    dev = devices.world_device()
    res = {}
    names = list(env.CONTROLS) + [env.SYMMETRIC]
    for arm, setting in _arms():
        for n in names:
            os.environ.pop(n, None)
        os.environ.update(setting)
        env.reset()  # the next Buffer reads the arm's settings
        out = {"errors": [], "problems": [], "views": set()}
        with ta.Buffer(None, cfg, device=dev) as buf:
            for step, tokens in enumerate(eager_plan(CAP)):
                inputs = [_inputs(cfg, a, tokens[a % len(tokens)], 50 + step)
                          for a in range(a_n)]
                _eager_exchange(buf, cfg, inputs, CAP, out, f"{arm} step {step}")
        dist.barrier()
        res[arm] = out
    return res


def _tol(dtype_name):
    return 2e-2 if dtype_name == "bfloat16" else 6e-2


@pytest.mark.parametrize("layout,dtype_name", [("2A2F", "bfloat16"), ("1A1F", "float8_e4m3fn")])
def test_token_layout_controls(layout, dtype_name):
    a_n, f_n = LAYOUTS[layout]
    res = devices.spawn_gpu_world(token_controls_body, a_n + f_n, a_n, f_n, dtype_name,
                                  timeout=240)
    tol = _tol(dtype_name)
    for r, arms in enumerate(res):
        for arm, out in arms.items():
            assert not out["problems"], (r, arm, out["problems"][:5])
            bad = [(tag, e) for tag, e in out["errors"] if not e < tol]
            assert not bad, (r, arm, bad[:5])
            assert len(out["views"]) <= 1, (r, arm, out["views"])


def run_token_graphs(layout, dtype_name, env=None, cap=CAP, zero_copy=False,
                     attention_form=None, ffn_form=None, ffn_receive_form=None,
                     attention_send_form=None, graph_tokens=None, experts=EXPERTS):
    """The token layout's graph test (test_token_layout_graphs) with these settings.
    attention_form / ffn_form / ffn_receive_form / attention_send_form: a kernel form
    (forms.h) that some collect of every Attention rank / some reply / some receive of every
    FFN rank / some dispatch of every Attention rank must have run (the test of a path then
    cannot pass on another). graph_tokens: the graphs' T per Attention index (cycled; default
    the bucket, 20 and 3, each at most the bucket). experts: E (top-k stays TOP_K). Returns
    every rank's record (token_graph_body)."""
    a_n, f_n = LAYOUTS[layout]
    res = devices.spawn_gpu_world(token_graph_body, a_n + f_n, a_n, f_n, dtype_name, REPLAYS,
                                  cap, zero_copy, graph_tokens, experts, env=env, timeout=240)
    tol = _tol(dtype_name)
    routes = 0
    for r, out in enumerate(res):
        # each control the test sets reached the kernels (a test of a control that did not
        # reach them would pass on the default path)
        if out["flags"] is not None:
            assert not devices.controls_missed(out["flags"], env), (r, env, hex(out["flags"]))
        assert not out["problems"], (r, out["problems"][:5])
        bad = [(tag, e) for tag, e in out["errors"] if not e < tol]
        assert not bad, (r, bad[:5])
        assert out["replays"] == REPLAYS, (r, out["replays"])
        if attention_form is not None and out["role"] == "attention":
            assert attention_form in out["forms"][1], (r, out["forms"])
        if ffn_form is not None and out["role"] == "ffn":
            assert ffn_form in out["forms"][1], (r, out["forms"])
        if ffn_receive_form is not None and out["role"] == "ffn":
            assert ffn_receive_form in out["forms"][0], (r, out["forms"])
        if attention_send_form is not None and out["role"] == "attention":
            assert attention_send_form in out["forms"][0], (r, out["forms"])
        routes += out["route_errors"]
    ffn = [o for o in res if o["views"]]
    assert len(ffn) == f_n
    for o in ffn:  # zero-copy: one window, the same address eagerly and in every replay
        assert len(o["views"]) == 1, o["views"]
    assert routes >= a_n * (REPLAYS // 5) - a_n, routes  # every hostile replay reported
    return res


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_token_layout_graphs(layout, dtype_name):
    """The defaults: eager exchanges, then CUDA graphs replayed with checked rows, hostile ids
    reported (run_token_graphs)."""
    run_token_graphs(layout, dtype_name)


@pytest.mark.parametrize("layout,dtype_name", [("1A1F", "bfloat16"), ("3A1F", "float8_e4m3fn")])
def test_token_layout_graphs_previous_defaults(layout, dtype_name):
    """test_token_layout_graphs (whose defaults preload the 3-token Attention rank's rows in
    3A1F and load every reply row with its token index) with the four small-batch controls
    reverted: AFDEP_PDL, AFDEP_ONE_FENCE, AFDEP_EARLY_LOADS and AFDEP_LL_SMALL at 0."""
    run_token_graphs(layout, dtype_name, env=devices.PREVIOUS_DEFAULTS)


@pytest.mark.parametrize("layout,dtype_name", [
    ("1A1F", "float8_e4m3fn"), ("2A2F", "bfloat16"), ("3A1F", "float8_e4m3fn"),
    ("1A3F", "float8_e4m3fn")])
def test_token_layout_ll_small_graphs(layout, dtype_name):
    """AFDEP_LL_SMALL=1 (the default) with a bucket of 4 over the 2 channels, so that every
    exchange sends flagged units both ways (at most 2 tokens per channel): test_token_layout_
    graphs' eager plan (T 0, 1, 3, 4 per Attention rank; a sender CTA with one token, at T = 1
    and 3, takes AFDEP_LONE_TOKEN's path) and 100 checked graph replays with hostile ids; the
    FFN's receive moves every row into its slot of the window (one view throughout); with one
    FFN rank the graphs collect zero-copy (the collect moves the reply units into the inbox row
    the caller's view reads), the eager exchanges with a copy. The other four layout x dtype
    cells run the same defaults in test_token_layout_early_collect_graphs."""
    run_token_graphs(layout, dtype_name, env={"AFDEP_LL_SMALL": "1"}, cap=4,
                     zero_copy=True)


# AFDEP_RAW_META (experimental, off by default): a lone token's metadata units are its raw ids
# and weights (kRawSend), each FFN rank deriving its columns (kRawRecv)
RAW = {"AFDEP_LL_SMALL": "1", "AFDEP_RAW_META": "1"}


@pytest.mark.parametrize("layout,dtype_name,extra", [
    ("1A1F", "bfloat16", {}), ("2A2F", "float8_e4m3fn", {}), ("3A1F", "bfloat16", {}),
    ("1A3F", "bfloat16", {}), ("1A1F", "float8_e4m3fn", {"AFDEP_SPREAD_CHUNKS": "0"})],
    ids=["1A1F", "2A2F", "3A1F", "1A3F", "1A1F-spread_off"])
def test_token_layout_raw_meta_graphs(layout, dtype_name, extra):
    """test_token_layout_ll_small_graphs with AFDEP_RAW_META=1 (experimental), the graphs at
    T = 3 and 1 over the 2 channels: a CTA of one token (T = 1; the second CTA at T = 3, whose
    token has a duplicated id) sends its raw ids and weights, the other CTA at T = 3 its two
    tokens' entries, so one receive takes both kinds of region; every FFN rank's rows exact
    (local ids, columns, weights, duplicates dropped), hostile ids reported, 100 checked
    replays (kRawRecv's spread instantiation, AFDEP_SPREAD_CHUNKS being on); and with that
    control at 0 (its other instantiation)."""
    run_token_graphs(layout, dtype_name, env={**RAW, **extra}, cap=4, zero_copy=True,
                     attention_send_form="kRawSend", ffn_receive_form="kRawRecv",
                     graph_tokens=[3, 1])


def test_token_layout_raw_meta_units_do_not_fit():
    """AFDEP_RAW_META=1 where a lone token's raw ids and weights (2 + 2k ints) do not fit its
    metadata units (meta_ints = 2 + 3R rounded up to 4): 1A3F with E = 6, k = 4, so E_local = 2,
    R = 2 and 8 < 10 ints. Every CTA then claims as without the control: the forms stay
    kSmallSend and kSmallRecv (never the raw ones) in every exchange, and every row is exact."""
    res = run_token_graphs("1A3F", "bfloat16", env=RAW, cap=4, zero_copy=True,
                           attention_send_form="kSmallSend",
                           ffn_receive_form="kSmallRecv", graph_tokens=[3, 1],
                           experts=6)
    for r, out in enumerate(res):
        assert not {"kRawSend", "kRawRecv"} & (out["forms"][0] | out["forms"][1]), (r, out)


def test_token_layout_raw_meta_needs_lone_token():
    """AFDEP_RAW_META=1 with AFDEP_LONE_TOKEN=0: no sender CTA takes the lone path, so there is
    no raw metadata to send and the forms stay kSmallSend and kSmallRecv; every row exact."""
    run_token_graphs("1A1F", "bfloat16", env={**RAW, "AFDEP_LONE_TOKEN": "0"}, cap=4,
                     zero_copy=True, attention_send_form="kSmallSend",
                     ffn_receive_form="kSmallRecv", graph_tokens=[3])


@pytest.mark.parametrize("layout,dtype_name", [("1A1F", "bfloat16"), ("2A2F", "float8_e4m3fn"),
                                               ("3A1F", "bfloat16")])
def test_token_layout_lone_token_reverted_graphs(layout, dtype_name):
    """test_token_layout_ll_small_graphs with AFDEP_LONE_TOKEN=0. By default a sender CTA
    holding one token (T = 1, and one of the two CTAs at T = 3) skips the shared-memory claim:
    warp 0 writes the metadata units while the other warps store the count and row units. With
    the control at 0 every CTA claims, meets a barrier, then copies (the units are the same)."""
    run_token_graphs(layout, dtype_name, env={"AFDEP_LL_SMALL": "1",
                                              "AFDEP_LONE_TOKEN": "0"},
                     cap=4, zero_copy=True)


@pytest.mark.parametrize("layout,dtype_name,cap", [("1A1F", "bfloat16", 4),
                                                   ("2A2F", "float8_e4m3fn", 4),
                                                   ("3A1F", "bfloat16", 4),
                                                   ("1A3F", "bfloat16", 4),
                                                   ("3A1F", "bfloat16", CAP)],
                         ids=["1A1F", "2A2F", "3A1F", "1A3F", "3A1F-count-form"])
def test_token_layout_early_collect_graphs(layout, dtype_name, cap):
    """test_token_layout_ll_small_graphs with AFDEP_EARLY_COLLECT=1 (the default; set here all
    the same, and test_token_layout_controls reverts it): the collect's row warps poll their
    reply units together with the FFN ranks' start units, with no barrier between
    (kEarlyCollect); several FFN ranks' rows summed in 2A2F and 1A3F, one FFN rank's zero-copy
    collect into the inbox rows in 1A1F and 3A1F. At
    bucket CAP the FFN replies in the count form: the eager plan's T = 0 and 1 exchanges
    (<= SMS: kEarlyCollect) meet it, their lanes finding the completion count, fencing and
    reading the inbox rows; a graph's T = 3 (> SMS) collect runs kSmallRecv."""
    run_token_graphs(layout, dtype_name,
                     env={"AFDEP_LL_SMALL": "1", "AFDEP_EARLY_COLLECT": "1"}, cap=cap,
                     zero_copy=True, attention_form="kEarlyCollect")


@pytest.mark.parametrize("layout,dtype_name,cap,value", [("1A1F", "bfloat16", 4, "1"),
                                                         ("2A2F", "float8_e4m3fn", 4, "1"),
                                                         ("1A3F", "bfloat16", 4, "1"),
                                                         ("3A1F", "bfloat16", CAP, "1"),
                                                         ("1A1F", "bfloat16", 4, "0"),
                                                         ("2A2F", "float8_e4m3fn", 4, "0")],
                         ids=["1A1F", "2A2F", "1A3F", "3A1F-count-form", "1A1F-reverted",
                              "2A2F-reverted"])
def test_token_layout_spread_chunks_graphs(layout, dtype_name, cap, value):
    """test_token_layout_early_collect_graphs with AFDEP_SPREAD_CHUNKS=1 (the default; set here
    all the same) and reverted: spread, the receive's (kSmallRecv, placing rows from their
    units), the reply's (kSmallSend) and the collect's (kEarlyCollect, kSmallRecv) chunks of a
    row are taken by one warp on each of several CTAs; reverted, by one CTA's warps; the same
    forms, every row exact."""
    run_token_graphs(layout, dtype_name,
                     env={"AFDEP_LL_SMALL": "1", "AFDEP_EARLY_COLLECT": "1",
                          "AFDEP_SPREAD_CHUNKS": value}, cap=cap,
                     zero_copy=True, attention_form="kEarlyCollect",
                     ffn_form="kSmallSend" if cap == 4 else None,
                     ffn_receive_form="kSmallRecv" if cap == 4 else None)


@pytest.mark.parametrize("layout,dtype_name,cap,small", [
    ("1A1F", "bfloat16", 4, "1"), ("2A2F", "float8_e4m3fn", 4, "1"), ("1A3F", "bfloat16", 4, "1"),
    ("3A1F", "bfloat16", CAP, "1"), ("2A2F", "bfloat16", 4, "0")],
    ids=["1A1F", "2A2F", "1A3F", "3A1F-count-form", "2A2F-generic"])
def test_token_layout_unit_signal_graphs(layout, dtype_name, cap, small):
    """test_token_layout_early_collect_graphs with AFDEP_UNIT_SIGNAL=1 (the default): the
    reply's CTAs that wrote only row units (kSmallSend, or the generic kernel with
    AFDEP_SMALL_KERNELS=0) add their counts unfenced, the start units' CTA fenced; at bucket
    CAP the FFN replies in the count form (every CTA fenced), whose rows the collect reads
    behind the count. Every row exact."""
    run_token_graphs(layout, dtype_name,
                     env={"AFDEP_LL_SMALL": "1", "AFDEP_UNIT_SIGNAL": "1",
                          "AFDEP_SMALL_KERNELS": small}, cap=cap,
                     zero_copy=True, attention_form="kEarlyCollect" if small == "1" else None,
                     ffn_form="kSmallSend" if cap == 4 and small == "1" else None)


@pytest.mark.parametrize("layout,dtype_name", [("1A1F", "bfloat16"), ("2A2F", "float8_e4m3fn"),
                                               ("1A3F", "bfloat16")])
def test_token_layout_match_any_graphs(layout, dtype_name):
    """test_token_layout_ll_small_graphs with AFDEP_SHUFFLE_MATCH=0: the sender's claim
    (kSmallSend's MATCH.ANY instantiation) finds a token's repeated ids by MATCH.ANY instead
    of shuffles. Every row exact, hostile ids reported."""
    run_token_graphs(layout, dtype_name,
                     env={"AFDEP_LL_SMALL": "1", "AFDEP_SHUFFLE_MATCH": "0"}, cap=4,
                     zero_copy=True, attention_send_form="kSmallSend")


@pytest.mark.parametrize("layout,dtype_name", [("1A1F", "bfloat16"), ("2A2F", "float8_e4m3fn"),
                                               ("1A3F", "bfloat16"), ("3A1F", "bfloat16")])
def test_token_layout_spin_each_graphs(layout, dtype_name):
    """test_token_layout_ll_small_graphs with AFDEP_SETTLE_UNITS=0 (on by default): the
    receive of flagged units (kSmallRecv's spread instantiation without settled units) spins on
    each of a token's metadata units in turn (3A1F: one receive takes three sources' tokens).
    Every row exact, hostile ids reported."""
    run_token_graphs(layout, dtype_name,
                     env={"AFDEP_LL_SMALL": "1", "AFDEP_SETTLE_UNITS": "0"}, cap=4,
                     zero_copy=True, attention_send_form="kSmallSend",
                     ffn_receive_form="kSmallRecv")


@pytest.mark.parametrize("layout,settle", [("1A1F", "1"), ("3A1F", "1"), ("1A1F", "0")],
                         ids=["1A1F", "3A1F", "1A1F-spin_each"])
def test_token_layout_delayed_sender(layout, settle):
    """Regression guard for the receive of flagged units: every eager dispatch waits 20 ms on
    the GPU first (AFDEP_TEST_DISPATCH_DELAY_MS), so the FFN's receive polls the token's
    stale metadata units from the previous exchange that long (AFDEP_SETTLE_UNITS, on by
    default: all of them at once; spin_each: each in turn) and must take only the new ones.
    Every row exact, then the graphs' 100 checked replays."""
    run_token_graphs(layout, "bfloat16",
                     env={"AFDEP_LL_SMALL": "1", "AFDEP_SETTLE_UNITS": settle,
                          "AFDEP_TEST_DISPATCH_DELAY_MS": "20"}, cap=4, zero_copy=True,
                     attention_send_form="kSmallSend", ffn_receive_form="kSmallRecv")


@pytest.mark.parametrize("layout,dtype_name", [("1A1F", "bfloat16"), ("2A2F", "float8_e4m3fn"),
                                               ("1A3F", "bfloat16")])
def test_token_layout_ll_generic_kernels_graphs(layout, dtype_name):
    """test_token_layout_ll_small_graphs with AFDEP_SMALL_KERNELS=0: the same flagged units
    through the generic kernels (every other test of the flagged units runs the small kernel
    forms, the default)."""
    run_token_graphs(layout, dtype_name, env={"AFDEP_LL_SMALL": "1",
                                              "AFDEP_SMALL_KERNELS": "0"},
                     cap=4, zero_copy=True)


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float8_e4m3fn"])
def test_token_layout_ll_small_sanitizer_small(dtype_name):
    """The flagged units under compute-sanitizer memcheck: 1A1F, bucket 4, eager plan and 10
    checked graph replays with hostile ids (collected zero-copy)."""
    res = devices.spawn_gpu_world(token_graph_body, 2, 1, 1, dtype_name, 10, 4, True,
                                  env={"AFDEP_LL_SMALL": "1"}, timeout=900)
    _check_small(res, dtype_name)


def test_token_layout_spin_each_sanitizer_small():
    """test_token_layout_ll_small_sanitizer_small (BF16) with AFDEP_SETTLE_UNITS=0 (that test
    runs the default, settled) under memcheck: the receive spinning on each metadata unit."""
    res = devices.spawn_gpu_world(token_graph_body, 2, 1, 1, "bfloat16", 10, 4, True,
                                  env={"AFDEP_LL_SMALL": "1", "AFDEP_SETTLE_UNITS": "0"},
                                  timeout=900)
    _check_small(res, "bfloat16")


def test_token_layout_spread_chunks_reverted_sanitizer_small():
    """test_token_layout_ll_small_sanitizer_small with AFDEP_SPREAD_CHUNKS=0 (that test runs
    the default, spread), under compute-sanitizer memcheck."""
    res = devices.spawn_gpu_world(token_graph_body, 2, 1, 1, "bfloat16", 10, 4, True,
                                  env={"AFDEP_LL_SMALL": "1", "AFDEP_SPREAD_CHUNKS": "0"},
                                  timeout=900)
    _check_small(res, "bfloat16")


def test_token_layout_raw_meta_sanitizer_small():
    """test_token_layout_ll_small_sanitizer_small with AFDEP_RAW_META=1, under
    compute-sanitizer memcheck: the graph at T = 3 (a raw region beside a claimed one), the
    dispatch in kRawSend and the receive in kRawRecv."""
    res = devices.spawn_gpu_world(token_graph_body, 2, 1, 1, "bfloat16", 10, 4, True, [3],
                                  env=RAW, timeout=900)
    _check_small(res, "bfloat16")
    for out in res:
        assert out["flags"] is None or out["flags"] & controls.CONTROLS["AFDEP_RAW_META"].bit
        want = {"attention": "kRawSend", "ffn": "kRawRecv"}[out["role"]]
        assert out["forms"][0] == {want}, out["forms"]


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float8_e4m3fn"])
def test_token_layout_sanitizer_small(dtype_name):
    """The token layout's eager plan and a few checked graph replays with hostile ids, 1A1F,
    for compute-sanitizer memcheck (scripts/gpu_suite.sh runs ``pytest -k sanitizer`` under
    it): no out-of-bounds access, and the results checked as in test_token_layout_graphs."""
    res = devices.spawn_gpu_world(token_graph_body, 2, 1, 1, dtype_name, 10, timeout=900)
    _check_small(res, dtype_name)


def _check_small(res, dtype_name):
    """A sanitizer world's results: no problems, errors within tolerance, 10 replays, the
    hostile replays reported."""
    tol = _tol(dtype_name)
    for r, out in enumerate(res):
        assert not out["problems"], (r, out["problems"][:5])
        bad = [(tag, e) for tag, e in out["errors"] if not e < tol]
        assert not bad, (r, bad[:5])
        assert out["replays"] == 10, (r, out["replays"])
    assert sum(o["route_errors"] for o in res) >= 1  # the hostile replays were reported


@pytest.mark.parametrize("arm", ["defaults", "ll_off", "early_collect_off"])
@pytest.mark.parametrize("layout,scenario", [("1A1F", "ffn_after_receive"),
                                             ("1A1F", "attention_before_collect"),
                                             ("2A2F", "ffn_after_receive"),
                                             ("2A2F", "attention_before_collect")])
def test_token_layout_rank_killed(layout, scenario, arm, tmp_path):
    """The token layout's kill test (the expert layout's: test_transport_faults.py, same
    scenarios and checks): a rank dies mid-exchange after two healthy, checked exchanges at
    2 tokens per channel; every survivor's wait ends at its deadline, its next op raises
    AfdepTimeoutError naming the dead peer (or, for a rank that waits for a survivor that
    gave up, a peer of the other role) and the phase, and it closes without its peers in
    < 2 s. defaults: the flagged units carry dispatch and reply (their waits spin on units)
    and the collect's row warps spin on their units with their own deadline
    (AFDEP_EARLY_COLLECT); ll_off: AFDEP_LL_SMALL=0, the count block and flags;
    early_collect_off: AFDEP_EARLY_COLLECT=0, every collect CTA waiting for the start units
    behind a barrier."""
    from tests.helpers import transport_bodies as hb

    a_n, f_n = LAYOUTS[layout]
    env = {"ll_off": {"AFDEP_LL_SMALL": "0"},
           "early_collect_off": {"AFDEP_EARLY_COLLECT": "0"}}.get(arm, {})
    w = hb.run_kill_world(token_kill_body, a_n + f_n, (a_n, f_n, str(tmp_path), scenario),
                          str(tmp_path), env=env)
    hb.check_kill_outcome(w, list(range(f_n)), list(range(f_n, f_n + a_n)), scenario)
