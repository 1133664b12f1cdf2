"""benchmarks/trace.py's arithmetic on synthetic stamps (the GPU run itself is in the GPU
suite's optional steps)."""

from __future__ import annotations

import types

import pytest
import torch

from benchmarks import trace


def _ring(n_last, ring, stamp):
    """[ring][2][points] stamps with stamp(n, phase, point) at the slots of exchanges <= n_last."""
    out = [[[0] * trace.POINTS for _ in range(2)] for _ in range(ring)]
    for n in range(n_last - ring + 1, n_last + 1):
        for ph in range(2):
            for pt in range(trace.POINTS):
                out[n % ring][ph][pt] = stamp(n, ph, pt)
    return out


def test_stage_medians_from_stamps():
    ring, last = 64, 200
    # (the latest CTA starts: Attention dispatch 0.125, combine 7.5; FFN receive 991, reply
    # 1014.5)
    # Attention: dispatch start 0, first loads 0.25, route mask 0.5, claimed 1, payload
    # written 3, sent 4, max sent 5 µs, end 6; combine start 7, waited 20 (the latest CTA
    # 20.5), CTA 0's end 21.25, the last CTA's end 22.
    att = {(0, trace.START): 0, (0, trace.LOADED): 0.25, (0, trace.MASKED): 0.5,
           (0, trace.CLAIMED): 1, (0, trace.COPIED): 3, (0, trace.SENT): 4,
           (0, trace.MAX_SENT): 5, (0, trace.MAX_END): 6, (0, trace.MAX_START): 0.125,
           (1, trace.START): 7, (1, trace.MAX_START): 7.5, (1, trace.WAITED): 20, (1, trace.MAX_WAITED): 20.5,
           (1, trace.END): 21.25, (1, trace.MAX_END): 22}
    # FFN, clock 1000 µs ahead: receive waited 1006 (the latest CTA 1006.75), table 1007, ready
    # 1009, token units seen 1010.5, CTA 0's end 1011, the last CTA's end 1012; reply start 1013, receipt loaded
    # 1013.25, first row loaded 1013.5, rows written 1016, CTA 0 sent 1016.5, max sent 1018.
    ffn = {(0, trace.START): 990, (0, trace.MAX_START): 991, (0, trace.WAITED): 1006, (0, trace.MAX_WAITED): 1006.75,
           (0, trace.TABLE): 1007, (0, trace.READY): 1009, (0, trace.END): 1011,
           (0, trace.LOADED): 1010.5, (0, trace.MAX_END): 1012, (1, trace.START): 1013,
           (1, trace.MAX_START): 1014.5,
           (1, trace.MASKED): 1013.25,
           (1, trace.LOADED): 1013.5, (1, trace.WRITTEN): 1016, (1, trace.SENT): 1016.5,
           (1, trace.MAX_SENT): 1018}

    def stamps(table):
        def at(n, ph, pt):  # ns; exchange n starts at n * 10 ms
            return (n * 10_000 + table[(ph, pt)]) * 1000 if (ph, pt) in table else 0
        return at

    got = [("attention", _ring(last, ring, stamps(att)), (last, last)),
           ("ffn", _ring(last, ring, stamps(ffn)), (last, last))]
    row = trace.summarize(8, got, [30.0, 31.0, 29.0], replays=60)
    s = row["stages_us"]
    assert row["tokens"] == 8 and row["latency_us"] == 30.0
    assert s["A dispatch: start -> last CTA sent"] == 5
    assert s["  A CTA0: start -> tokens claimed"] == 1
    assert s["    A CTA0: start -> first loads arrived"] == 0.25
    assert s["    A CTA0: first loads arrived -> tokens claimed"] == 0.75
    assert s["      A CTA0: first loads arrived -> route mask known"] == 0.25
    assert s["      A CTA0: route mask known -> tokens claimed"] == 0.5
    assert s["  A CTA0: claimed -> payload written"] == 2
    assert s["  A CTA0: payload written -> counts signalled"] == 1
    assert s["  A dispatch: CTA0 signalled -> last CTA signalled"] == 1
    assert s["  F CTA0: rows written -> signalled"] == 0.5
    assert s["  F reply: CTA0 signalled -> last CTA signalled"] == 1.5
    assert s["  F CTA0: counts seen -> count table loaded"] == 1
    assert s["  F CTA0: start -> reduced rows written"] == 3
    assert s["    F CTA0: start -> first row loaded"] == 0.5
    assert s["    F CTA0: first row loaded -> rows written"] == 2.5
    assert s["    F CTA0: start -> receipt loaded"] == 0.25
    assert s["    F CTA0: receipt loaded -> first rows loaded"] == 0.25
    assert s["A gap: dispatch end -> combine start"] == 1
    assert s["F counts seen -> offsets ready"] == 3
    assert s["F expansion (ready -> last CTA end)"] == 3
    assert s["  F CTA0: ready -> its end"] == 2
    assert s["    F CTA0: ready -> token units seen"] == 1.5
    assert s["    F CTA0: token units seen -> its end"] == 0.5
    assert s["  F receive: CTA0 counts seen -> last CTA counts seen"] == 0.75
    assert s["F gap: receive end -> reply start"] == 1
    assert s["A collect (done seen -> last CTA end)"] == 2
    assert s["  A CTA0: done seen -> its end"] == 1.25
    assert s["  A collect: CTA0 done seen -> last CTA done seen"] == 0.5
    assert s["A kernels total (dispatch start -> combine end)"] == 22
    # each kernel's latest CTA start against CTA 0's
    assert s["  A dispatch: CTA0 start -> last CTA start"] == 0.125
    assert s["  F receive: CTA0 start -> last CTA start"] == 1
    assert s["  F reply: CTA0 start -> last CTA start"] == 1.5
    assert s["  A collect: CTA0 start -> last CTA start"] == 0.5
    assert s["A kernels total - F gap"] == 21
    # each crossing includes the 1000 µs clock offset, with opposite signs: their sum is the
    # true 1 µs (A -> F) + 2 µs (F -> A)
    cross = (s["x A last sent -> F CTA0 counts seen"] + s["x F last signal -> A CTA0 done seen"])
    assert s["x A last sent -> F CTA0 counts seen"] == 1001 and cross == 3
    # the token layout's receive never stamps the count table: that stage is absent, not a
    # difference against 0 (which once printed as -1.8e15 µs), and the rest stays
    del ffn[(0, trace.TABLE)]
    got[1] = ("ffn", _ring(last, ring, stamps(ffn)), (last, last))
    s2 = trace.summarize(8, got, [30.0, 31.0, 29.0], replays=60)["stages_us"]
    assert "  F CTA0: counts seen -> count table loaded" not in s2
    assert {k: v for k, v in s.items() if k != "  F CTA0: counts seen -> count table loaded"} == s2
    # units seen after the offsets (token layout): the expert layout's split is absent
    assert "  F CTA0: counts seen -> token units seen" not in s
    assert "  F CTA0: token units seen -> offsets ready" not in s
    # the expert layout's lone receive: token units seen at 1008, before the offsets (1009);
    # the split of "counts seen -> offsets ready" is there, the token layout's is not
    ffn[(0, trace.LOADED)] = 1008
    ffn[(0, trace.MASKED)] = 1008.25
    got[1] = ("ffn", _ring(last, ring, stamps(ffn)), (last, last))
    s3 = trace.summarize(8, got, [30.0, 31.0, 29.0], replays=60)["stages_us"]
    assert s3["  F CTA0: counts seen -> token units seen"] == 2
    assert s3["  F CTA0: token units seen -> offsets ready"] == 1
    assert s3["    F CTA0: token units seen -> row known"] == 0.25
    assert s3["    F CTA0: row known -> offsets ready"] == 0.75
    assert "    F CTA0: token units seen -> row known" not in s  # no row stamp there
    assert s3["F counts seen -> offsets ready"] == 3
    assert "    F CTA0: ready -> token units seen" not in s3
    assert "    F CTA0: token units seen -> its end" not in s3


def test_stream_stamps_map_each_replay_to_its_exchange():
    """Replay j of `replays` timed ones is exchange last - (replays - 1 - j). Its start stamp
    lies (j + 1) µs before the dispatch starts and its end stamp 3 µs after the combine ends;
    an off-by-one mapping would shift the first by 10 ms (exchanges are 10 ms apart)."""
    ring, last, replays = 64, 100, 5
    table = {(0, trace.START): 0, (0, trace.MAX_END): 5, (1, trace.START): 6,
             (1, trace.MAX_END): 20}

    def at(n, ph, pt):
        return (n * 10_000 + table[(ph, pt)]) * 1000 if (ph, pt) in table else 0

    got = [("attention", _ring(last, ring, at), (last, last)),
           ("ffn", _ring(last, ring, lambda n, ph, pt: 0), (last, last))]
    st, lat = [], []
    for j in range(replays):
        t0 = (last - (replays - 1 - j)) * 10_000_000
        st.append([t0 - 1000 * (j + 1), t0 + 23_000])
        lat.append(30.0 + j)
    row = trace.summarize(8, got, lat, replays, st)
    s, sp = row["stages_us"], row["spread_us"]
    assert s["A kernels total (dispatch start -> combine end)"] == 20
    assert "A kernels total - F gap" not in s  # the FFN stamped nothing: no F gap to take off
    assert sp["A stream: start stamp -> dispatch start"] == {"median": 3, "p90": 5, "max": 5}
    assert s["A stream: combine end -> end stamp"] == 3
    assert s[trace.OUTSIDE] == 12 and sp[trace.OUTSIDE]["max"] == 14
    assert row["latency_spread_us"] == {"median": 32.0, "p90": 34.0, "max": 34.0}
    # without stream stamps those stages are absent, the rest unchanged
    row2 = trace.summarize(8, got, lat, replays)
    assert "A stream: combine end -> end stamp" not in row2["stages_us"]
    assert row2["stages_us"][trace.OUTSIDE] == 12


def test_back_to_back_exchanges_split_by_position():
    """--exchanges-per-replay 2: replay j holds exchanges last - 2 (replays - 1 - j) - 1 (its
    first, position 0) and that + 1 (position 1). Odd exchanges take 20 µs of kernels, even
    ones 10 (last is odd), so a wrong position would mix them; the start stamp belongs to
    position 0 and lies (j + 1) µs before its dispatch, the end stamp to position 1, 3 µs after
    its combine; the outside-kernel line needs one exchange per replay and is absent."""
    ring, last, replays, k = 64, 101, 5, 2

    def at(n, ph, pt):
        end = 20 if n % 2 else 10
        table = {(0, trace.START): 0, (0, trace.MAX_END): 5, (1, trace.START): 6,
                 (1, trace.MAX_END): end}
        return (n * 10_000 + table[(ph, pt)]) * 1000 if (ph, pt) in table else 0

    got = [("attention", _ring(last, ring, at), (last, last)),
           ("ffn", _ring(last, ring, lambda n, ph, pt: 0), (last, last))]
    st = []
    for j in range(replays):
        first = last - k * (replays - 1 - j) - 1
        st.append([first * 10_000_000 - 1000 * (j + 1), ((first + 1) * 10_000 + 20 + 3) * 1000])
    lat = [50.0 + j for j in range(replays)]
    rows = [trace.summarize(8, got, lat, replays, st, per_replay=k, position=p)
            for p in range(k)]
    s0, s1 = rows[0]["stages_us"], rows[1]["stages_us"]
    assert [r["position"] for r in rows] == [0, 1]
    assert s0["A kernels total (dispatch start -> combine end)"] == 10
    assert s1["A kernels total (dispatch start -> combine end)"] == 20
    assert rows[0]["spread_us"]["A stream: start stamp -> dispatch start"]["max"] == 5
    assert s0["A stream: start stamp -> dispatch start"] == 3
    assert "A stream: combine end -> end stamp" not in s0
    assert s1["A stream: combine end -> end stamp"] == 3
    assert "A stream: start stamp -> dispatch start" not in s1
    assert trace.OUTSIDE not in s0 and trace.OUTSIDE not in s1
    with pytest.raises(ValueError, match=r"position must be in \[0, per_replay=2\)"):
        trace.summarize(8, got, lat, replays, st, per_replay=k, position=2)


def test_same_sm_share_from_the_sm_point():
    """The SM point (%smid + 1, not a time) of two kernels' CTA 0s: the share of exchanges in
    which the Attention's dispatch ran on the FFN receive's SM and the reply on the collect's;
    an exchange where one side is unstamped (0) is left out of its pair; --compare shows the
    shares beside the stages."""
    ring, last = 64, 200

    def att(n, ph, pt):  # dispatch on SM 2 in one exchange of 4 (else SM 6), collect on SM 8
        if pt == trace.SM:
            return (3 if n % 4 == 0 else 7) if ph == trace.D else 9
        return n * 10_000_000 + (ph * trace.POINTS + pt + 1) * 1000

    def ffn(n, ph, pt):  # receive on SM 2; reply on SM 8, unstamped in even exchanges
        if pt == trace.SM:
            return 3 if ph == trace.D else (9 if n % 2 else 0)
        return n * 10_000_000 + 500_000 + (ph * trace.POINTS + pt + 1) * 1000

    got = [("attention", _ring(last, ring, att), (last, last)),
           ("ffn", _ring(last, ring, ffn), (last, last))]
    row = trace.summarize(1, got, [12.0] * 40, replays=60)  # exchanges 161..200
    assert row["same_sm"] == {"A dispatch CTA0 on F receive CTA0's SM": 0.25,
                              "F reply CTA0 on A collect CTA0's SM": 1.0}, row["same_sm"]
    assert all(v < 1000 for v in row["stages_us"].values())  # no SM taken for a time


@pytest.mark.parametrize("argv,fragment", [
    (["--afdep-env", "AFDEP_NOPE=1"], "--afdep-env takes NAME=0|1"),
    (["--afdep-env", "AFDEP_WIDE_LOCAL=maybe"], "got 'AFDEP_WIDE_LOCAL=maybe'"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--local-sms", "-1"], "--local-sms must be in [0, 1024] (0: the default), got -1"),
    (["--exchanges-per-replay", "0"], "--exchanges-per-replay must be in [1, 8], got 0"),
    (["--queue-ahead-us", "-1"], "--queue-ahead-us must be in [0, 10000]"),
    (["--tokens", "64", "--capacity", "32"], "--tokens must be in [1, --capacity=32]"),
    (["--tokens", "0"], "--tokens must be in [1, --capacity=max T]"),
    (["--stand-in", "gemm"], "invalid choice: 'gemm'"),
])
def test_bad_arguments_fail_before_any_gpu_work(argv, fragment, capsys):
    with pytest.raises(SystemExit):
        trace.main(argv)
    assert fragment in capsys.readouterr().err


def test_compare_prints_saved_runs_side_by_side(tmp_path, capsys):
    """--compare (no GPU): per arm and token count of the first file, each stage's median over
    a file's repeats in its own column, "-" where a file lacks the stage or the row; a legend
    names each file with its commit and the afdep arm's controls."""
    import json

    a_stage = "A dispatch kernel (start -> last CTA end)"
    b_stage = "F expansion (ready -> last CTA end)"

    def row(tokens, stages):
        return {"tokens": tokens, "position": 0, "stages_us": stages}

    first = {"args": {"receive_layout": "tokens", "afdep_env": []}, "commit": "aaa",
             "machine": "m", "results": {"afdep": [[row(1, {a_stage: 2.0, b_stage: 1.5}),
                                                    row(32, {a_stage: 3.0})]]}}
    # two repeats: the median of 2.0 and 3.0 is 2.5; no T = 32 row
    second = {"args": {"receive_layout": "tokens", "afdep_env": ["AFDEP_X=1"]},
              "commit": "bbb", "machine": "m",
              "results": {"afdep": [[row(1, {a_stage: 2.0})], [row(1, {a_stage: 3.0})]]}}
    paths = []
    for name, doc in (("a.json", first), ("b.json", second)):
        (tmp_path / name).write_text(json.dumps(doc))
        paths.append(str(tmp_path / name))
    assert trace.main(["--compare", *paths]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("a.json: commit aaa, m, tokens layout"), out[0]
    assert out[1].endswith("b.json: commit bbb, m, tokens layout, AFDEP_X=1"), out[1]
    lines = {line[:62].rstrip(): line[62:].split() for line in out if line[:62].strip()}
    assert out.index("== afdep, T=1 (median µs)") < out.index("== afdep, T=32 (median µs)")
    t1 = out[out.index("== afdep, T=1 (median µs)"):out.index("== afdep, T=32 (median µs)")]
    t1 = {line[:62].rstrip(): line[62:].split() for line in t1[2:] if line.strip()}
    assert t1 == {a_stage: ["2.00", "2.50"], b_stage: ["1.50", "-"]}, t1
    assert lines[a_stage] == ["3.00", "-"]  # T = 32 (the later line of the same stage)
    with pytest.raises(SystemExit):
        trace.main(["--compare", str(tmp_path / "absent.json")])
    assert "--compare: cannot read" in capsys.readouterr().err


def test_points_match_the_cuda_extension():
    """trace.py's point indices cover the kernels' kTracePts (exported as TRACE_POINTS)."""
    cuda = pytest.importorskip("torch_afdep._cuda")
    assert cuda.TRACE_POINTS == trace.POINTS


def test_trace_runs_on_two_gpus_or_one_under_mps():
    assert trace.trace_devices(2, False) == [0, 1]
    assert trace.trace_devices(8, True) == [0, 1]
    assert trace.trace_devices(1, True) == [0, 0]  # both ranks on one GPU under MPS
    assert trace.trace_devices(1, False) is None   # time-sliced spinning kernels: refused
    assert trace.trace_devices(0, True) is None


class _FakeBuf:
    """The FFN half of a Buffer for _AfdepCell.step: records what the reply sent."""

    def __init__(self, x):
        self.x, self.sent = x, None
        self.transport = types.SimpleNamespace(last_forms=("kSmallRecv", "kSmallSend"))

    def worker_receive(self, bucket):
        return types.SimpleNamespace(x=self.x, receipt=("receipt", bucket))

    def worker_reply(self, rows, receipt):
        self.sent = (rows, receipt)


@pytest.mark.parametrize("stand_in", ["copy", "none"])
def test_stand_in_between_receive_and_reply(stand_in):
    """--stand-in: "copy" replies stand_in_expert of the received rows (every arm's expert),
    "none" the cell's reply tensor untouched (the trace's launch-gap diagnostic)."""
    from benchmarks import arms, torch_exchange as tx

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 256, generator=g).to(torch.bfloat16)
    reply = torch.full((6, 256), 3.0, dtype=torch.bfloat16)
    cell = arms._AfdepCell.__new__(arms._AfdepCell)  # no world: only step's FFN half runs
    cell.rk = types.SimpleNamespace(is_attention=False)
    cell.buf, cell.bucket, cell.stand_in, cell.extra = _FakeBuf(x), 6, stand_in, {}
    cell.reply = reply.clone()
    cell.step()
    rows, receipt = cell.buf.sent
    assert receipt == ("receipt", 6) and rows is cell.reply
    assert cell.extra["kernel_forms"] == ["kSmallRecv", "kSmallSend"]  # what the step ran
    want = reply.clone()
    if stand_in == "copy":
        want = tx.stand_in_expert(want, x)
        assert not torch.equal(want, reply)  # the copy changed the rows
    assert torch.equal(rows, want)


def test_stand_in_rejects_unknown_names():
    from benchmarks import arms

    with pytest.raises(ValueError, match="stand_in must be one of"):
        arms._AfdepCell(None, None, None, 0, None, stand_in="gemm")
