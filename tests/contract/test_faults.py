"""Faults on CPU with real processes: a peer killed in the middle of an exchange, a rank that
skips an exchange, out-of-order calls and wrong receipts. (On CUDA a waiting kernel ends at
its own deadline and the transport reports it: tests/gpu/test_transport_faults.py.)

Two spawned worlds (rank 0 FFN, rank 1 Attention; bodies in
tests/helpers/lifecycle_bodies.py):
``faults_world`` runs the ordering, skip and kill-the-FFN parts; ``kill_attention_world``
kills the Attention rank. A killed rank makes ``spawn_world`` raise ``WorldError`` naming it;
the survivor's record comes back through its results file.
"""

import multiprocessing
import time

import pytest

from torch_afdep.testing import WorldError, spawn_world

from tests.helpers import lifecycle_bodies as fb

FFN, ATTN = fb.FFN_RANK, fb.ATTN_RANK
#: A world that had to wait for spawn_world's own timeout would take this long: the test
#: requires the whole world (startup included) to end well before it.
WORLD_TIMEOUT = 150.0


def _run_killing_world(body, outdir, dead_rank):
    t0 = time.monotonic()
    with pytest.raises(WorldError) as info:
        spawn_world(body, 2, outdir, timeout=WORLD_TIMEOUT)
    elapsed = time.monotonic() - t0
    survivor = 1 - dead_rank
    return {
        "message": str(info.value),
        "elapsed": elapsed,
        "children": multiprocessing.active_children(),
        "survivor": fb.load_results(outdir, survivor),
        "dead": fb.load_results(outdir, dead_rank),
    }


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    return _run_killing_world(fb.faults_world, str(tmp_path_factory.mktemp("faults")),
                              dead_rank=FFN)


@pytest.fixture(scope="module")
def kill_attention(tmp_path_factory):
    return _run_killing_world(fb.kill_attention_world,
                              str(tmp_path_factory.mktemp("kill_attention")), dead_rank=ATTN)


def value(results, name):
    rec = results[name]
    if not rec["ok"]:
        pytest.fail(f"part {name!r} raised:\n{rec['error']}")
    return rec["value"]


def _check_world_ended(w, dead_rank):
    # Only the killed rank failed, and spawn_world says how.
    assert f"--- rank {dead_rank} failed:" in w["message"]
    assert "process exited with code 1" in w["message"]
    assert f"--- rank {1 - dead_rank} failed:" not in w["message"], w["message"]
    # The survivor finished and exited by itself: no child left, no wait for the world timeout.
    assert w["children"] == []
    assert w["elapsed"] < WORLD_TIMEOUT - 30, w["elapsed"]


def _check_peer_error(err, peer, rank, phases):
    assert err is not None, "the survivor did not notice the dead peer"
    assert err["is_afdep"], err
    # a dead peer is AfdepPeerLostError (a kind of AfdepTimeoutError), in our words
    assert err["type"] in ("AfdepTimeoutError", "AfdepPeerLostError"), err
    assert "GLHF" not in err["message"], err
    assert (err["peer"], err["rank"]) == (peer, rank), err
    assert err["phase"] in phases, err
    assert f"group rank {peer}" in err["message"]
    assert err["phase"] in err["message"]
    # Noticed within the configured timeout of the death (gloo reports the closed connection).
    assert err["after_death"] < fb.FAST_TIMEOUT + 1.0, err


def test_ffn_killed_after_receive(faults):
    _check_world_ended(faults, dead_rank=FFN)
    k = value(faults["survivor"], "kill_ffn")
    assert k["first"]["exact"]
    # The Attention rank's source_collect names the FFN rank and the combine phase.
    _check_peer_error(k["error"], peer=FFN, rank=ATTN, phases=("combine",))
    assert k["error"]["waited"] < fb.FAST_TIMEOUT + 1.0
    assert "unusable after an earlier failure" in k["after"]
    assert k["close_s"] < 1.0
    assert faults["survivor"]["registry_at_end"] == []


def test_attention_killed_after_dispatch(kill_attention):
    _check_world_ended(kill_attention, dead_rank=ATTN)
    k = value(kill_attention["survivor"], "kill_attention")
    assert k["first"] is True
    # The FFN rank took the dispatch, replied (the send cannot complete), and its next call
    # reports the Attention rank: in combine (the pending reply) or dispatch (no next input).
    _check_peer_error(k["error"], peer=ATTN, rank=FFN, phases=("combine", "dispatch"))
    assert k["calls"][-1] == k["error"]["call"]
    assert "unusable after an earlier failure" in k["after"]
    assert k["close_s"] < 1.0


def test_skipped_exchange_times_out(faults):
    s_ffn = value(faults["dead"], "skip")  # the FFN rank was killed only in the later part
    s_attn = value(faults["survivor"], "skip")
    assert s_ffn["first"] is True and s_attn["first"]["exact"]
    err = s_ffn["error"]
    # The FFN rank waited for the Attention rank's dispatch: a timeout, not a hang.
    assert err is not None and err["type"] == "AfdepTimeoutError", err
    assert (err["peer"], err["phase"], err["rank"]) == (ATTN, "dispatch", FFN), err
    assert fb.FAST_TIMEOUT - 0.5 < err["waited"] < fb.FAST_TIMEOUT + 2.0, err
    assert "group rank 1" in err["message"]
    assert "unusable after an earlier failure" in s_ffn["after"]
    # Both ranks close within a bounded time: the failed one without its peers, the other
    # reports that its closing barrier could not meet the failed rank.
    assert s_ffn["close"] is None and s_ffn["close_s"] < 1.0
    assert s_attn["close"] is not None and s_attn["close"]["type"] == "AfdepTimeoutError"
    assert s_attn["close"]["phase"] == "close"
    assert s_attn["close_s"] < fb.FAST_TIMEOUT + 2.0


@pytest.mark.parametrize("case, kind, fragment", [
    ("reply_before_receive", "AfdepStateError", "without a preceding worker_receive"),
    ("receive_twice", "AfdepStateError", "twice without worker_reply"),
    ("stale_receipt", "AfdepStateError", "stale receipt: it is from exchange 1, the current "
                                         "one is 2"),
    ("foreign_receipt", "ValueError", "receipt belongs to buffer"),
    ("wrong_bucket_receipt", "ValueError", "rows must have shape"),
    ("not_a_receipt", "TypeError", "receipt must be the Receipt"),
    ("rows_of_other_bucket", "ValueError", "rows must have shape [8, 128]"),
    ("collect_before_dispatch", "AfdepStateError", "without a preceding source_dispatch"),
    ("dispatch_twice", "AfdepStateError", "twice without source_collect"),
])
def test_ordering_errors_are_clear(faults, case, kind, fragment):
    errors = {**value(faults["dead"], "ordering")["errors"],
              **value(faults["survivor"], "ordering")["errors"]}
    msg = errors[case]
    assert msg.startswith(kind + ": "), msg
    assert fragment in msg, msg


def test_next_exchange_after_errors_is_exact(faults):
    o_attn = value(faults["survivor"], "ordering")
    o_ffn = value(faults["dead"], "ordering")
    # The other buffer's exchange, then exchanges 0-3 of the buffer the errors hit; each
    # following a rejected call. Bit for bit, and close to the fp64 reference.
    assert len(o_attn["exact"]) == 5
    for r in o_attn["exact"]:
        assert r["exact"] and r["rel"] < 1e-2, r
    assert o_ffn["errors"] and o_attn["errors"]


def test_world_stack_dump_names_where_a_rank_waits(capfd, monkeypatch):
    """AFDEP_WORLD_STACKS_S: each rank of a spawned world prints its stack when it is still
    running after N seconds (how run 19 found a hung NCCL test)."""
    # spawned ranks write to this test's stderr (forked ones to the fork server's)
    monkeypatch.setenv("AFDEP_WORLD_START", "spawn")
    # the timer starts before the process group forms; the last rank to join sleeps at 1 s
    out = spawn_world(fb.sleeping_body, 2, 5.0, env={"AFDEP_WORLD_STACKS_S": "1"}, timeout=60)
    assert out == [0, 1]
    err = capfd.readouterr().err
    # the two ranks dump at the same moment into one stderr, and faulthandler writes each
    # piece of a frame line on its own, so the dumps may interleave piece by piece (CI saw
    # "in 694sleeping_body"): look for the function's name, one piece, not " in " before it
    assert err.count("Timeout (0:00:01)") == 2 and "sleeping_body" in err, err[-2000:]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_ranks_printing_at_once_never_split_a_line(method):
    """Ranks share the caller's stdout: under PYTHONUNBUFFERED (a print is then two writes,
    its text and its newline) four ranks printing 300 lines each at once still give whole
    lines (CI once saw one rank's line end inside another's)."""
    import os
    import re
    import subprocess
    import sys

    code = ("from torch_afdep.testing import spawn_world\n"
            "from tests.helpers import lifecycle_bodies as fb\n"
            "assert spawn_world(fb.printing_body, 4, 300) == [300] * 4\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", AFDEP_WORLD_START=method)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                           os.path.abspath(__file__)))))
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("rank ") or "line" in ln]
    bad = [ln for ln in lines if not re.fullmatch(r"rank [0-3] line \d+ x{80}", ln)]
    assert not bad and len(lines) == 1200, (len(lines), bad[:3])


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_world_ranks_see_the_callers_environment_of_the_moment(monkeypatch, method):
    """Forked CPU ranks (the default) and spawned ones alike see the environment the caller
    has when it calls spawn_world, plus ``env``: a variable set after the fork server
    started, one removed since, and one passed in."""
    import os

    from torch_afdep.testing import _start_method

    assert _start_method(None) == "forkserver" and _start_method([0, 0]) == "spawn"
    monkeypatch.setenv("AFDEP_WORLD_START", method)
    monkeypatch.setenv("AFDTEST_PROBE_GONE", "x")
    spawn_world(fb.environ_body, 2, [])  # (re)uses the fork server with the variable set
    monkeypatch.delenv("AFDTEST_PROBE_GONE")
    monkeypatch.setenv("AFDTEST_PROBE_SET", "late")
    out = spawn_world(fb.environ_body, 2,
                      ["AFDTEST_PROBE_SET", "AFDTEST_PROBE_GONE", "AFDTEST_PROBE_ENV"],
                      env={"AFDTEST_PROBE_ENV": "given"})
    for values, ppid in out:
        assert values == ["late", None, "given"], values
        assert (ppid == os.getpid()) == (method == "spawn"), (method, ppid, os.getpid())


def test_world_ranks_bind_gloo_to_loopback_unless_told(monkeypatch):
    """A spawned world runs on this host, so its ranks' gloo binds the loopback interface when
    the caller names none (no hostname lookup, which can stall without DNS); a caller's
    GLOO_SOCKET_IFNAME is kept."""
    import os

    if not os.path.isdir("/sys/class/net/lo"):
        pytest.skip("no interface named lo")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    out = spawn_world(fb.environ_body, 2, ["GLOO_SOCKET_IFNAME"])
    assert [values for values, _ in out] == [["lo"], ["lo"]], out
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # the caller's environment is untouched
    # the caller's choice wins ("lo," names the same interface in gloo's list syntax)
    out = spawn_world(fb.environ_body, 2, ["GLOO_SOCKET_IFNAME"],
                      env={"GLOO_SOCKET_IFNAME": "lo,"})
    assert [values for values, _ in out] == [["lo,"], ["lo,"]], out
