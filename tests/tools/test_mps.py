"""torch_afdep.mps on CPU: MPS is detected from its control pipe in a fake pipe directory, and
the shared-GPU message names the fix."""

import os

from torch_afdep import mps


def test_pipe_directory_default_and_override(tmp_path):
    assert mps.pipe_directory({}) == "/tmp/nvidia-mps"
    assert mps.pipe_directory({"CUDA_MPS_PIPE_DIRECTORY": " "}) == "/tmp/nvidia-mps"
    assert mps.pipe_directory({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) == str(tmp_path)


def test_running_only_with_a_control_fifo(tmp_path):
    environ = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert not mps.mps_running(environ)  # empty directory
    (tmp_path / "control").write_text("")
    assert not mps.mps_running(environ)  # a regular file is not the daemon's pipe
    os.remove(tmp_path / "control")
    os.mkfifo(tmp_path / "control")
    assert mps.mps_running(environ)
    assert not mps.mps_running({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "missing")})


def test_shared_gpu_problem(tmp_path):
    environ = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    empty_proc = tmp_path / "proc"
    empty_proc.mkdir()
    assert mps.shared_gpu_problem(1, environ, str(empty_proc)) is None
    msg = mps.shared_gpu_problem(3, environ, str(empty_proc))
    assert msg.startswith("3 ranks would share one GPU but CUDA MPS is not running")
    assert f"no control pipe in {tmp_path}" in msg
    assert "`nvidia-cuda-mps-control -d`" in msg and "scripts/gpu_suite.sh" in msg
    assert "pid" not in msg
    # A daemon serving another pipe directory: the message says so.
    (empty_proc / "4242").mkdir()
    (empty_proc / "4242" / "cmdline").write_bytes(b"/usr/bin/nvidia-cuda-mps-control\0-d\0")
    (empty_proc / "77").mkdir()
    (empty_proc / "77" / "cmdline").write_bytes(b"python\0x.py\0")
    assert mps.daemon_pids(str(empty_proc)) == [4242]
    assert "(pid 4242) but not with this pipe directory" in mps.shared_gpu_problem(
        2, environ, str(empty_proc))
    os.mkfifo(tmp_path / "control")
    assert mps.shared_gpu_problem(2, environ, str(empty_proc)) is None
    assert mps.daemon_pids(str(tmp_path / "no-proc")) == []


def test_running_with_a_control_socket(tmp_path):
    """The lent H200's MPS daemon serves a Unix socket named control, not a FIFO."""
    import socket

    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert not mps.mps_running(env)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(tmp_path / "control"))
        assert mps.mps_running(env)
    finally:
        sock.close()
