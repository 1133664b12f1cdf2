"""``python -m torch_afdep doctor``: sections, --json, --verbose, simulated problems and their
hints (in-process through main(argv)), MPS on a (fake) one-GPU machine, and one real run as a
subprocess with the self-test."""

import json
import os
import subprocess
import sys

import pytest
import torch

import torch_afdep
from torch_afdep import __main__ as cli
from torch_afdep import controls, doctor, env
from torch_afdep.testing import WorldError

SECTIONS = ["== versions", "== extensions", "== GPUs", "== transport", "== environment",
            "== self-test", "== result"]
JSON_KEYS = {"ok", "problems", "warnings", "versions", "extensions", "gpus", "transport",
             "environment", "selftest"}


@pytest.fixture
def clean_env(monkeypatch):
    """A known-good environment: multicast off, no AFDEP_* variables."""
    for name in list(os.environ):
        if name.startswith("AFDEP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "1")
    return monkeypatch


def row(out, key):
    """The value printed after ``key`` on its line of the text report."""
    for line in out.splitlines():
        if line.strip().startswith(key + " "):
            return line.strip()[len(key):].strip()
    raise AssertionError(f"no line for {key!r} in:\n{out}")


def run_json(capsys, *argv):
    rc = doctor.main(["--json", "--no-selftest", *argv])
    return rc, json.loads(capsys.readouterr().out)


def test_text_sections(clean_env, capsys):
    rc = doctor.main(["--no-selftest"])
    out = capsys.readouterr().out
    assert rc == 0, out
    pos = [out.index(s) for s in SECTIONS]
    assert pos == sorted(pos), out
    assert row(out, "torch") == torch.__version__
    assert row(out, "torch_afdep._C").startswith("built, importable; compiled against torch")
    assert row(out, "afdep c10d backend") == "registered"
    assert "NCCL_NVLS_ENABLE" in out
    assert "skipped (--no-selftest)" in out
    assert "OK: no problems found" in out
    if not torch.cuda.is_available():
        assert row(out, "GPUs") == "none"
        assert row(out, "cpu-gloo").startswith("CPU: gloo point-to-point messages")
        assert row(out, "NCCL (loaded by torch)") == "n/a"


def test_json_keys(clean_env, capsys):
    rc, d = run_json(capsys)
    assert rc == 0 and d["ok"] is True and d["problems"] == []
    assert JSON_KEYS <= set(d)
    assert d["versions"]["torch"] == torch.__version__
    assert d["versions"]["torch_afdep"] == torch_afdep.__version__
    assert set(d["versions"]) >= {"cuda_torch", "nccl_torch", "nccl_headers_extension"}
    c = d["extensions"]["_C"]
    assert c["importable"] and c["matches_torch"] and c["backend_registered"]
    assert c["torch_version"] == torch_afdep._C.TORCH_VERSION
    assert set(d["extensions"]["_cuda"]) >= {"importable", "error", "device_count"}
    env = d["environment"]
    assert set(env["controls"]) == set(controls.CONTROLS)
    for name, info in env["controls"].items():
        assert info["value"] is None and info["effective"] == controls.CONTROLS[name].default
        assert info["meaning"] == controls.CONTROLS[name].description
    assert env["control_mode"] == "role-aware"
    assert env["multicast"]["NCCL_NVLS_ENABLE"]["value"] == "0"
    assert d["transport"]["name"] in ("cpu-gloo", "cuda-ipc")
    assert d["selftest"]["cpu"] == {"ran": False, "reason": "--no-selftest"}
    if not torch.cuda.is_available():
        assert d["gpus"] == {"available": False, "count": 0, "devices": [], "peer_access": []}
        assert d["transport"]["name"] == "cpu-gloo"
        assert d["versions"]["nccl_torch"] == "n/a"


def test_nvls_enabled_is_a_problem(clean_env, capsys):
    clean_env.setenv("NCCL_NVLS_ENABLE", "1")
    rc = doctor.main(["--no-selftest"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAIL: 1 problem(s)" in out
    assert "- NCCL_NVLS_ENABLE is not 0 (it is '1'): export NCCL_NVLS_ENABLE=0" in out
    rc, d = run_json(capsys)
    assert rc == 1 and d["ok"] is False
    assert len(d["problems"]) == 1 and d["problems"][0].startswith("NCCL_NVLS_ENABLE is not 0")


def test_nvls_unset_without_gpus_is_silent(clean_env, capsys):
    """No GPU: nothing uses NCCL, so an unset NCCL_NVLS_ENABLE is neither a problem nor a
    warning (the old doctor warned); with GPUs it is a problem."""
    clean_env.delenv("NCCL_NVLS_ENABLE")
    clean_env.setattr(torch.cuda, "is_available", lambda: False)
    rc, d = run_json(capsys)
    assert rc == 0 and d["problems"] == []
    assert not [w for w in d["warnings"] if "NCCL_NVLS_ENABLE" in w], d["warnings"]
    rc = doctor.main(["--no-selftest"])
    out = capsys.readouterr().out
    assert "warning: NCCL_NVLS_ENABLE" not in out and "OK: no problems found" in out


def test_default_text_gives_the_control_mode_not_the_list(clean_env, capsys):
    rc = doctor.main(["--no-selftest"])
    out = capsys.readouterr().out
    assert rc == 0
    assert row(out, "protocol controls").startswith("role-aware")
    named = [n for n in env.CONTROLS if n in out]
    assert named == [], named  # the old doctor printed every control with its meaning
    assert "other AFDEP_* variables set: none" in out
    clean_env.setenv("AFDEP_SINGLE_FFN", "0")
    doctor.main(["--no-selftest"])
    out = capsys.readouterr().out
    assert row(out, "protocol controls").startswith(
        "mixed: AFDEP_SINGLE_FFN=0 (defaults otherwise)")
    assert [n for n in env.CONTROLS if n in out] == ["AFDEP_SINGLE_FFN"]
    clean_env.setenv("AFDEP_SYMMETRIC", "1")
    doctor.main(["--no-selftest"])
    out = capsys.readouterr().out
    assert row(out, "protocol controls").startswith("symmetric")


def test_verbose_lists_every_control_and_variable(clean_env, capsys):
    rc = doctor.main(["--no-selftest", "--verbose"])
    out = capsys.readouterr().out
    assert rc == 0
    lines = out.splitlines()
    for name, s in env.SETTINGS.items():
        line = next(ln for ln in lines if ln.strip().startswith(name + " "))
        assert s.meaning[:40] in line, line
        if name in env.CONTROLS:
            assert f"-> {s.default}" in line, line
    assert "protocol controls (torch_afdep.env; mode: role-aware)" in out


def test_variables_come_from_the_registry(clean_env, capsys):
    """Every registered non-control variable is known (the old hand-written list missed some,
    e.g. AFDEP_TEST_BUFFERS, and called them unknown) and shown when set; malformed values are
    problems, named as torch_afdep.env parses them."""
    assert doctor.OTHER_AFDEP_ENV == {
        n: s.meaning for n, s in env.SETTINGS.items() if n not in env.CONTROLS}
    clean_env.setenv("AFDEP_TEST_BUFFERS", "5")
    rc, d = run_json(capsys)
    assert rc == 0 and d["environment"]["afdep_unknown"] == {}
    assert d["environment"]["afdep_other"]["AFDEP_TEST_BUFFERS"]["value"] == "5"
    doctor.main(["--no-selftest"])
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("AFDEP_TEST_BUFFERS"))
    assert env.SETTINGS["AFDEP_TEST_BUFFERS"].meaning[:30] in line
    assert "other AFDEP_* variables set: 1" in out
    clean_env.setenv("AFDEP_TRANSPORT", "shm")
    rc, d = run_json(capsys)
    assert rc == 1
    assert any(p.startswith("AFDEP_TRANSPORT='shm' is invalid (AFDEP_TRANSPORT must be one "
                            "of ipc, nccl") for p in d["problems"]), d["problems"]


def test_one_gpu_without_mps_warns(clean_env, capsys, tmp_path):
    """A (fake) one-GPU machine: ranks share the GPU, so the doctor names the MPS fix; with the
    daemon's control pipe present it does not."""
    from types import SimpleNamespace

    props = SimpleNamespace(name="Fake H200", major=9, minor=0, total_memory=141 * 2**30)
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "device_count", lambda: 1)
    clean_env.setattr(torch.cuda, "get_device_properties", lambda i: props)
    clean_env.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    rc, d = run_json(capsys)
    assert d["gpus"]["mps_running"] is False
    assert any("nvidia-cuda-mps-control -d" in w for w in d["warnings"]), d["warnings"]
    os.mkfifo(tmp_path / "control")
    rc, d = run_json(capsys)
    assert d["gpus"]["mps_running"] is True
    assert not any("MPS" in w for w in d["warnings"]), d["warnings"]
    doctor.main(["--no-selftest"])
    assert row(capsys.readouterr().out, "CUDA MPS") == "running"


def test_torch_version_mismatch_is_a_problem(clean_env, capsys):
    clean_env.setattr(torch_afdep._C, "TORCH_VERSION", "2.0.1")
    rc = doctor.main(["--no-selftest"])
    out = capsys.readouterr().out
    assert rc == 1
    assert (f"- _C built against torch 2.0.1, running {torch.__version__}: rebuild with "
            "pip install --no-build-isolation --no-deps -e .") in out
    assert "(MISMATCH)" in out
    rc, d = run_json(capsys)
    assert d["extensions"]["_C"]["matches_torch"] is False


def test_c_extension_missing_is_a_problem(clean_env, capsys):
    clean_env.setattr(doctor, "c_extension",
                      lambda: (None, "ImportError: undefined symbol: _ZN3c10foo"))
    rc, d = run_json(capsys)
    assert rc == 1
    assert d["extensions"]["_C"]["importable"] is False
    assert any("torch_afdep._C (the afdep c10d backend) cannot be imported" in p
               and "pip install --no-build-isolation --no-deps -e ." in p
               for p in d["problems"]), d["problems"]


def test_bad_control_value_is_a_problem(clean_env, capsys):
    clean_env.setenv("AFDEP_ROLE_BUFFERS", "maybe")
    rc, d = run_json(capsys)
    assert rc == 1
    assert any(p.startswith("bad protocol control: AFDEP_ROLE_BUFFERS must be 0 or 1")
               for p in d["problems"]), d["problems"]
    assert d["environment"]["controls"]["AFDEP_ROLE_BUFFERS"]["value"] == "maybe"


def test_bad_roles_env_is_a_problem(clean_env, capsys):
    clean_env.setenv("AFDEP_ROLES", "FFXA")
    rc, d = run_json(capsys)
    assert rc == 1
    assert any(p.startswith("AFDEP_ROLES='FFXA' is invalid") for p in d["problems"])
    clean_env.setenv("AFDEP_ROLES", "ffn,attention")  # every parse_roles spelling is fine
    rc, d = run_json(capsys)
    assert rc == 0, d["problems"]


def test_symmetric_and_reverted_controls_are_reported(clean_env, capsys):
    clean_env.setenv("AFDEP_SINGLE_FFN", "0")
    rc, d = run_json(capsys)
    assert rc == 0
    env = d["environment"]
    assert env["controls"]["AFDEP_SINGLE_FFN"] == {
        "value": "0", "default": 1, "effective": 0,
        "meaning": controls.CONTROLS["AFDEP_SINGLE_FFN"].description}
    assert env["control_mode"] == "mixed: AFDEP_SINGLE_FFN=0 (defaults otherwise)"
    clean_env.setenv("AFDEP_RAW_META", "1")
    rc, d = run_json(capsys)
    assert d["environment"]["control_mode"] == (
        "mixed: AFDEP_SINGLE_FFN=0, AFDEP_RAW_META=1 (defaults otherwise)")
    clean_env.delenv("AFDEP_SINGLE_FFN")
    clean_env.delenv("AFDEP_RAW_META")
    rc, d = run_json(capsys)
    assert d["environment"]["control_mode"] == "role-aware"
    clean_env.setenv("AFDEP_SYMMETRIC", "1")
    rc, d = run_json(capsys)
    assert rc == 0
    assert d["environment"]["control_mode"].startswith("symmetric")
    assert d["environment"]["control_mask"] == 0
    assert d["environment"]["afdep_other"]["AFDEP_SYMMETRIC"]["value"] == "1"


def test_unknown_afdep_variable_is_a_warning(clean_env, capsys):
    clean_env.setenv("AFDEP_ROLE_BUFERS", "0")  # a typo
    rc, d = run_json(capsys)
    assert rc == 0
    assert d["environment"]["afdep_unknown"] == {"AFDEP_ROLE_BUFERS": "0"}
    assert any("AFDEP_ROLE_BUFERS is set but not read by torch_afdep (did you mean "
               "AFDEP_ROLE_BUFFERS?)" in w for w in d["warnings"])


def test_retired_control_is_a_warning_naming_its_fate(clean_env, capsys):
    clean_env.setenv("AFDEP_LONE_SPLIT", "1")  # retired in session 36
    rc, d = run_json(capsys)
    assert rc == 0
    assert d["environment"]["afdep_unknown"] == {"AFDEP_LONE_SPLIT": "1"}
    assert d["environment"]["control_mask"] == env.DEFAULT_FLAGS  # no bit of its own
    assert any("AFDEP_LONE_SPLIT is set but a retired control (removed in session 36"
               in w and "it has no effect" in w for w in d["warnings"])
    assert doctor.main(["--no-selftest"]) == 0
    out = capsys.readouterr().out
    assert row(out, "AFDEP_LONE_SPLIT") == "1        (retired: no effect)", out


def test_selftest_failure_gives_its_error(clean_env, capsys):
    layouts = []

    def failing(fn, world, *args, **kwargs):
        assert fn is doctor.selftest_body and world == 2 and args[0] == "cpu"
        layouts.append(args[1])
        raise WorldError("\n--- rank 1 failed:\nTraceback (most recent call last):\n  File "
                         "\"x.py\", line 1\nAfdepTimeoutError: rank 1: combine waited more "
                         "than 30.0 s for group rank 0\n")

    clean_env.setattr(doctor, "_spawn", failing)
    rc = doctor.main([])
    out = capsys.readouterr().out
    assert rc == 1
    assert layouts == ["experts", "tokens"]  # one world per receive layout
    for layout in layouts:
        assert (f"- self-test failed: cpu 1A1F, {layout} layout: rank 1: AfdepTimeoutError: "
                "rank 1: combine waited more than 30.0 s for group rank 0") in out
        assert row(out, f"cpu {layout}").startswith("FAIL after")


def test_selftest_wrong_numbers_fail(clean_env, capsys):
    def wrong(fn, world, *args, **kwargs):
        return [{"role": "ffn", "errors": [], "counts_ok": [True, False]},
                {"role": "attention", "errors": [0.001, 0.5], "counts_ok": []}]

    clean_env.setattr(doctor, "_spawn", wrong)
    rc = doctor.main(["--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert d["selftest"]["cpu"]["ran"] and not d["selftest"]["cpu"]["ok"]
    for layout in ("experts", "tokens"):
        cpu = d["selftest"]["cpu"]["layouts"][layout]
        assert cpu["ran"] and not cpu["ok"] and cpu["max_rel_error"] == 0.5
        assert cpu["receive_layout"] == layout
        assert "combined output differs from the reference" in cpu["error"]
        assert "per-expert counts differ" in cpu["error"]
    assert [p.split(":")[1] for p in d["problems"]] == [" cpu 1A1F, experts layout",
                                                         " cpu 1A1F, tokens layout"]


def test_selftest_reports_each_layout(clean_env, capsys):
    """Only the token layout fails: one problem naming it, the expert layout still passes."""
    def tokens_wrong(fn, world, device_kind, layout, **kwargs):
        err = 0.3 if layout == "tokens" else 0.002
        return [{"role": "ffn", "errors": [], "counts_ok": [True, True]},
                {"role": "attention", "errors": [0.001, err], "counts_ok": []}]

    clean_env.setattr(doctor, "_spawn", tokens_wrong)
    rc = doctor.main([])
    out = capsys.readouterr().out
    assert rc == 1
    assert row(out, "cpu experts").startswith("PASS: 2 exchanges, max rel. error 2.00e-03")
    assert row(out, "cpu tokens").startswith("FAIL after")
    assert out.count("- self-test failed:") == 1
    assert "- self-test failed: cpu 1A1F, tokens layout: combined output differs" in out


def test_fake_gpus_peer_access_transport_and_nvls(clean_env, capsys):
    """The GPU branches, with torch.cuda faked: 3 GPUs, GPU 2 cannot reach GPU 0."""
    from types import SimpleNamespace

    props = SimpleNamespace(name="Fake H200", major=9, minor=0, total_memory=141 * 2**30)
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "device_count", lambda: 3)
    clean_env.setattr(torch.cuda, "get_device_properties", lambda i: props)
    clean_env.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) != (2, 0))
    clean_env.delenv("NCCL_NVLS_ENABLE")
    clean_env.delenv("NVSHMEM_DISABLE_NVLS")
    rc, d = run_json(capsys)
    assert rc == 1
    g = d["gpus"]
    assert g["available"] and g["count"] == 3 and len(g["devices"]) == 3
    assert g["devices"][0] == {"index": 0, "name": "Fake H200", "capability": "9.0",
                               "memory_bytes": 141 * 2**30}
    assert g["peer_access"][2] == [False, True, True] and g["peer_access"][0] == [True] * 3
    assert any(p.startswith("GPU pairs without peer access: [(2, 0)]") for p in d["problems"])
    # With GPUs, an unset NCCL_NVLS_ENABLE is a problem, the other multicast switches warn.
    assert any(p.startswith("NCCL_NVLS_ENABLE is not 0 (unset") for p in d["problems"])
    assert any(w.startswith("NVSHMEM_DISABLE_NVLS is not 1") for w in d["warnings"])
    cuda_built = d["extensions"]["_cuda"]["importable"]
    assert d["transport"]["name"] == ("cuda-ipc" if cuda_built else "cpu-gloo")
    if not cuda_built:
        assert any("torch_afdep._cuda cannot be imported" in p for p in d["problems"])
    rc = doctor.main(["--no-selftest"])
    out = capsys.readouterr().out
    assert row(out, "cuda:2") == "Fake H200 (sm_90, 141.0 GiB)"
    assert "peer access (row can access column):" in out


def test_short_world_error():
    msg = ("\n--- rank 0 failed:\nprocess exited with code 1\n--- rank 1 failed:\nTraceback "
           "(most recent call last):\n  File \"a\", line 2\nValueError: bad\n")
    assert doctor._short_world_error(msg) == ("rank 0: process exited with code 1; "
                                              "rank 1: ValueError: bad")
    assert doctor._short_world_error("ranks [1] did not finish within 60 s") == \
        "ranks [1] did not finish within 60 s"


def test_alias_module_is_the_tool():
    import torch_afdep.doctor
    import torch_afdep.tools.doctor

    assert torch_afdep.doctor is torch_afdep.tools.doctor is doctor


def test_cli_dispatch(clean_env, capsys):
    assert cli.main(["doctor", "--no-selftest", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert cli.main([]) == 2
    assert "doctor" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    capsys.readouterr()
    assert cli.main(["bogus"]) == 2
    assert "unknown command 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--help"])
    assert e.value.code == 0
    assert "--layout" in capsys.readouterr().out


def test_subprocess_with_selftest():
    """The real thing: ``python -m torch_afdep doctor --json`` with its 2-process self-test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFDEP_")}
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    p = subprocess.run([sys.executable, "-m", "torch_afdep", "doctor", "--json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    d = json.loads(p.stdout)
    assert d["ok"] is True and d["problems"] == []
    assert d["selftest"]["cpu"]["ran"] and d["selftest"]["cpu"]["ok"], d["selftest"]
    assert set(d["selftest"]["cpu"]["layouts"]) == {"experts", "tokens"}
    for layout, cpu in d["selftest"]["cpu"]["layouts"].items():
        assert cpu["ran"] and cpu["ok"] and cpu["receive_layout"] == layout, cpu
        assert cpu["exchanges"] == 2 and cpu["max_rel_error"] < 1e-2
        print(f"doctor self-test ({layout}): {cpu['seconds']} s, max rel. error "
              f"{cpu['max_rel_error']:.2e}")
    if not torch.cuda.is_available():
        assert d["selftest"]["cuda"] == {"ran": False, "reason": "no GPU"}


def _cuda_ready():
    if not torch.cuda.is_available():
        return False
    return doctor.cuda_extension()[0] is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA GPU and torch_afdep._cuda")
@pytest.mark.parametrize("layout", ["experts", "tokens"])
def test_cuda_selftest_on_gpus(clean_env, layout):
    res = doctor.run_selftest("cuda", receive_layout=layout)
    assert res["ok"], res
    assert res["receive_layout"] == layout
    n = torch.cuda.device_count()
    assert res["device_ids"] == [0, 1 % n]
    assert res["max_rel_error"] < 1e-2


def test_nccl_versions_of_the_extension():
    """What the CUDA extension was built against and what it loaded: a mismatch is a problem
    (the NCCL transport refuses to start then), an extension without NCCL says so."""
    from types import SimpleNamespace

    def versions(code, loaded):
        rep = doctor.Report()
        ext = SimpleNamespace(NCCL_VERSION_CODE=code, nccl_runtime_version=lambda: loaded,
                              runtime_version=lambda: 13000)
        doctor.check_versions(rep, ext)
        return rep.facts["versions"], rep.problems

    v, problems = versions(22809, 22809)
    assert v["nccl_headers_extension"] == "2.28.9" and v["nccl_loaded_extension"] == "2.28.9"
    assert problems == []
    v, problems = versions(22809, 23007)
    assert v["nccl_loaded_extension"] == "2.30.7"
    assert len(problems) == 1 and "built against NCCL 2.28.9 but libnccl 2.30.7" in problems[0]
    v, problems = versions(0, -1)
    assert v["nccl_headers_extension"].startswith("n/a (built without NCCL")
    assert v["nccl_loaded_extension"] == "n/a" and problems == []


def test_transport_selection(clean_env):
    from torch_afdep._cuda_impl import transport_kind

    assert transport_kind({}) == "ipc"
    assert transport_kind({"AFDEP_TRANSPORT": " NCCL "}) == "nccl"
    with pytest.raises(ValueError, match=r"AFDEP_TRANSPORT must be one of ipc, nccl, "
                                         r"got 'shm'"):
        transport_kind({"AFDEP_TRANSPORT": "shm"})
    assert "AFDEP_TRANSPORT" in doctor.OTHER_AFDEP_ENV
