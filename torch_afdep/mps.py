"""Is CUDA MPS running, and does a layout that puts several ranks on one GPU need it?

Ranks of one group that share a GPU each run kernels that spin on flags written by a peer.
Without the MPS (Multi-Process Service) daemon the GPU time-slices between the processes'
contexts, so a rank's spinning kernel holds the GPU while the peer it waits for is switched
out: results stay correct but every exchange takes tens of milliseconds (34 ms measured on
one H200, about 1,000x the shared-context time). With MPS the ranks' kernels run side by
side.

No GPU call is needed: the MPS control daemon (``nvidia-cuda-mps-control -d``) creates a
named pipe ``control`` in its pipe directory (``CUDA_MPS_PIPE_DIRECTORY``, default
``/tmp/nvidia-mps``), and a CUDA client finds the daemon through that same directory.

- ``mps_running(environ=None) -> bool``
- ``shared_gpu_problem(ranks_per_gpu, environ=None) -> Optional[str]``
"""

from __future__ import annotations

import os
import stat
from typing import List, Mapping, Optional

#: Where the MPS daemon and its clients meet when CUDA_MPS_PIPE_DIRECTORY is unset.
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"

#: How scripts/gpu_suite.sh starts the daemon (it also exports its pipe and log directories).
START_COMMAND = "nvidia-cuda-mps-control -d"


def pipe_directory(environ: Optional[Mapping[str, str]] = None) -> str:
    """The pipe directory this process's CUDA clients would use.

    Arguments:
        environ: the environment to read (default: os.environ).
    Returns:
        ``CUDA_MPS_PIPE_DIRECTORY`` when set and non-empty, else ``/tmp/nvidia-mps``.
    """
    environ = os.environ if environ is None else environ
    return environ.get("CUDA_MPS_PIPE_DIRECTORY", "").strip() or DEFAULT_PIPE_DIRECTORY


def mps_running(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether an MPS control daemon serves this process's pipe directory.

    Arguments:
        environ: the environment to read (default: os.environ).
    Returns:
        True when ``<pipe directory>/control`` exists and is a named pipe (FIFO) or a socket. The pipe,
        not the daemon process, is what counts: a daemon started with another pipe directory
        does not serve this process, and in a container the daemon may run in another PID
        namespace where no process list shows it.
    """
    path = os.path.join(pipe_directory(environ), "control")
    try:  # a FIFO, or a Unix socket in the MPS of current drivers (seen on the lent H200)
        mode = os.stat(path).st_mode
        return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
    except OSError:  # missing, or a directory we may not read
        return False


def daemon_pids(proc_root: str = "/proc") -> List[int]:
    """Process ids of running ``nvidia-cuda-mps-control`` processes (Linux /proc; empty
    elsewhere or when /proc cannot be read).

    Arguments:
        proc_root: the proc file system to scan (tests pass a fake one).
    Returns:
        Sorted process ids whose command's program name is ``nvidia-cuda-mps-control``.
    """
    pids = []
    try:
        entries = os.listdir(proc_root)
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc_root, entry, "cmdline"), "rb") as f:
                argv0 = f.read().split(b"\0", 1)[0]
        except OSError:  # the process ended while we looked, or is not ours to read
            continue
        if os.path.basename(argv0.decode(errors="replace")) == "nvidia-cuda-mps-control":
            pids.append(int(entry))
    return sorted(pids)


def shared_gpu_problem(ranks_per_gpu: int, environ: Optional[Mapping[str, str]] = None,
                       proc_root: str = "/proc") -> Optional[str]:
    """A message saying why and how to start MPS when ``ranks_per_gpu`` ranks would share a
    GPU without it; None when nothing is wrong.

    Arguments:
        ranks_per_gpu: the most ranks of one group placed on any one GPU.
        environ: the environment to read (default: os.environ).
        proc_root: the proc file system to look for a daemon in (tests pass a fake one).
    Returns:
        None when ``ranks_per_gpu <= 1`` or ``mps_running(environ)``; else one paragraph
        naming the fix (start ``nvidia-cuda-mps-control -d``, as scripts/gpu_suite.sh does).
    """
    if ranks_per_gpu <= 1 or mps_running(environ):
        return None
    where = pipe_directory(environ)
    msg = (f"{ranks_per_gpu} ranks would share one GPU but CUDA MPS is not running (no "
           f"control pipe in {where}): their spinning kernels then time-slice the GPU and "
           f"every exchange takes tens of milliseconds (34 ms measured, about 1,000x slower; "
           f"results stay correct). Start the MPS control daemon first: `{START_COMMAND}` "
           f"(as scripts/gpu_suite.sh does; set CUDA_MPS_PIPE_DIRECTORY to the same directory "
           f"for the daemon and the ranks), or give every rank its own GPU.")
    pids = daemon_pids(proc_root)
    if pids:
        msg += (f" An nvidia-cuda-mps-control process runs (pid {', '.join(map(str, pids))}) "
                f"but not with this pipe directory: set CUDA_MPS_PIPE_DIRECTORY to its pipe "
                f"directory.")
    return msg


__all__ = ["DEFAULT_PIPE_DIRECTORY", "START_COMMAND", "pipe_directory", "mps_running",
           "daemon_pids", "shared_gpu_problem"]
