"""benchmarks/trace.py's arithmetic on synthetic stamps (the GPU run itself is in the GPU
suite's optional steps)."""

from __future__ import annotations

from benchmarks import trace


def _ring(n_last, ring, stamp):
    """[ring][2][8] stamps with stamp(n, phase, point) at the slots of exchanges <= n_last."""
    out = [[[0] * 8 for _ in range(2)] for _ in range(ring)]
    for n in range(n_last - ring + 1, n_last + 1):
        for ph in range(2):
            for pt in range(8):
                out[n % ring][ph][pt] = stamp(n, ph, pt)
    return out


def test_stage_medians_from_stamps():
    ring, last = 64, 200
    # Attention: dispatch start 0, sent/max sent 5 µs, end 6; combine start 7, waited 20, end 22.
    att = {(0, trace.START): 0, (0, trace.MAX_SENT): 5, (0, trace.MAX_END): 6,
           (1, trace.START): 7, (1, trace.WAITED): 20, (1, trace.MAX_END): 22}
    # FFN, clock 1000 µs ahead: receive waited 1006, ready 1009, end 1012; reply start 1013,
    # max sent 1018.
    ffn = {(0, trace.START): 990, (0, trace.WAITED): 1006, (0, trace.READY): 1009,
           (0, trace.MAX_END): 1012, (1, trace.START): 1013, (1, trace.MAX_SENT): 1018}

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
    assert s["A gap: dispatch end -> combine start"] == 1
    assert s["F counts seen -> offsets ready"] == 3
    assert s["F expansion (ready -> last CTA end)"] == 3
    assert s["F gap: receive end -> reply start"] == 1
    assert s["A collect (done seen -> last CTA end)"] == 2
    assert s["A kernels total (dispatch start -> combine end)"] == 22
    # each crossing includes the 1000 µs clock offset, with opposite signs: their sum is the
    # true 1 µs (A -> F) + 2 µs (F -> A)
    cross = (s["x A last sent -> F CTA0 counts seen"] + s["x F last signal -> A CTA0 done seen"])
    assert s["x A last sent -> F CTA0 counts seen"] == 1001 and cross == 3
