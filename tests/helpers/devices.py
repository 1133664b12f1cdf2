"""Where a test world runs: the contract suite's ``device`` parameter and the GPU rules.

- ``cpu`` always runs (gloo).
- ``cuda`` needs CUDA and the built ``torch_afdep._cuda``. Rank ``r`` of a world takes GPU
  ``r % n_gpus``. Ranks that share a GPU each run kernels spinning on flags a peer writes; that
  needs CUDA MPS (the kernels of several processes side by side), so such layouts run only
  with ``AFDEP_TEST_SHARED_GPU=1`` (``scripts/gpu_suite.sh`` exports it after it started the
  MPS daemon) and skip with that reason otherwise. With one GPU every multi-rank world shares.

Nothing here touches a GPU at import, so the helper modules import on any machine.
"""

from __future__ import annotations

from typing import List, Mapping, Optional

import pytest
import torch

from torch_afdep import env

#: Environment of every GPU world: NVLink multicast stays off on the shared machines.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}

#: The four small-batch controls (default 1) reverted together: the defaults before them.
PREVIOUS_DEFAULTS = {"AFDEP_PDL": "0", "AFDEP_ONE_FENCE": "0", "AFDEP_EARLY_LOADS": "0",
                     "AFDEP_LL_SMALL": "0"}


def controls_missed(flags: int, settings: Optional[Mapping[str, str]]) -> List[str]:
    """The protocol controls that ``settings`` (a world's environment) sets but the rank's
    transport ``flags`` do not carry as set: a test of a control that never reached the
    kernels would pass on the default path. Other variables in ``settings`` are ignored."""
    return [name for name, value in (settings or {}).items() if name in env.CONTROLS
            and bool(flags & env.CONTROLS[name].bit) != (value == "1")]


#: The devices of the contract suite, in parameter order.
DEVICES = ("cpu", "cuda")


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cuda_missing() -> Optional[str]:
    """Why CUDA tests cannot run here (None when they can): no GPU, or no extension."""
    if gpu_count() < 1:
        return "needs a CUDA GPU"
    try:
        import torch_afdep._cuda  # noqa: F401
    except Exception as e:  # ImportError, or a broken build
        return f"needs the built torch_afdep._cuda extension ({type(e).__name__}: {e})"
    return None


def require_gpu_module() -> None:
    """Skip the calling test module unless a GPU and the extension are there.

    ``AFDEP_GPU_BODIES_ON_CPU=1`` imports the module anyway, so a script can smoke-test the
    bodies that also run on the CPU path (the tests themselves still need a GPU)."""
    if env.get("AFDEP_GPU_BODIES_ON_CPU"):
        return
    why = cuda_missing()
    if why:
        pytest.skip(why, allow_module_level=True)


def rank_devices(world: int, gpus: Optional[int] = None) -> List[int]:
    """GPU of each rank: ``r % n_gpus`` (several ranks per GPU when there are few)."""
    n = gpu_count() if gpus is None else gpus
    return [r % max(n, 1) for r in range(world)]


def shared_gpu_problem(device_ids) -> Optional[str]:
    """Why a layout cannot run here (None when it can): ranks share a GPU without MPS."""
    ids = list(device_ids)
    if len(set(ids)) < len(ids) and not env.get("AFDEP_TEST_SHARED_GPU"):
        return (f"ranks share a GPU (devices {ids}): needs CUDA MPS "
                "(AFDEP_TEST_SHARED_GPU=1, which scripts/gpu_suite.sh sets after starting "
                "the MPS daemon) or one GPU per rank")
    return None


def need_gpus(n: int, why: str):
    """skipif marker: fewer than ``n`` GPUs (for layouts that need one rank per GPU)."""
    return pytest.mark.skipif(gpu_count() < n, reason=f"needs {n} CUDA GPUs: {why}")


def spawn_gpu_world(fn, world, *args, device_ids=None, env=None, **kw):
    """``spawn_world`` on GPUs: ``device_ids`` default ``rank_devices(world)``; skips (with the
    reason) a layout whose shared GPUs have no MPS. ``GPU_ENV`` is always set."""
    from torch_afdep.testing import spawn_world

    ids = rank_devices(world) if device_ids is None else list(device_ids)
    why = shared_gpu_problem(ids)
    if why:
        pytest.skip(why)
    return spawn_world(fn, world, *args, device_ids=ids, env={**GPU_ENV, **(env or {})}, **kw)


def spawn_on(device: str, fn, world, *args, env=None, **kw):
    """Run a contract body on ``device`` ("cpu" or "cuda"); the body gets ``device`` as its
    last argument and builds its Buffer with ``rank_device(device)``."""
    if device == "cpu":
        from torch_afdep.testing import spawn_world

        return spawn_world(fn, world, *args, device, env=env, **kw)
    assert device == "cuda", device
    why = cuda_missing()
    if why:
        pytest.skip(why)
    return spawn_gpu_world(fn, world, *args, device, env=env, **kw)


def param(name: str):
    """The pytest parameter of one device: ``cuda`` is marked ``gpu`` and skips (with the
    reason) where CUDA or the extension is missing."""
    if name == "cpu":
        return pytest.param("cpu", id="cpu")
    why = cuda_missing()
    return pytest.param("cuda", id="cuda",
                        marks=[pytest.mark.gpu, pytest.mark.skipif(why is not None,
                                                                   reason=why or "")])


# ---- inside a spawned rank ---------------------------------------------------------------
def rank_device(device: str) -> torch.device:
    """The rank's torch device for a contract body's ``device`` argument (spawn_world has set
    the rank's current GPU)."""
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_device() -> torch.device:
    """The spawned rank's GPU when it has one, else the CPU (GPU bodies smoke-tested on CPU)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync(dev) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()
