"""The ``"afdep"`` c10d backend: registration, options and the group -> roles registry.

``register_backend()`` (run on ``import torch_afdep``) makes these work::

    dist.init_process_group(backend="afdep", ...)
    dist.init_process_group(backend="cpu:gloo,cuda:afdep", ...)
    dist.new_group(ranks, backend="afdep", pg_options=AfdepOptions(roles="FFAA"))

An afdep group is an ordinary process group whose backend (``torch_afdep._C.AfdepBackend``,
C++) knows the role (``"attention"`` / ``"ffn"``) of every group rank and runs the standard
collectives on inner backends: gloo for CPU tensors and, where CUDA is available, NCCL for
CUDA tensors. DeviceMesh, DTensor and functional collectives therefore work on it unchanged.

Roles of a new afdep group, first match wins:

1. ``pg_options=AfdepOptions(roles=...)``: a list of ``"attention"``/``"ffn"`` or a string
   such as ``"FFAA"``, one entry per group rank.
2. The environment variable ``AFDEP_ROLES`` (same two spellings). If it has one entry per
   group rank it is used as is; if it has one entry per rank of the default group and the new
   group is a subgroup, each member takes the entry of its global rank.
3. The documented default: group ranks ``[0, F)`` are FFN, the rest Attention, with
   ``F = max(1, size // 2)``.
"""

from __future__ import annotations

import copy
import re
import sys
import threading
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import env as afdep_env
from ..config import ATTENTION, FFN, parse_roles

_REBUILD = "pip install --no-build-isolation --no-deps -e ."

try:
    from .. import _C
except ImportError as _e:  # pragma: no cover - depends on the build
    raise ImportError(
        f"torch_afdep._C (the 'afdep' c10d backend) could not be loaded ({_e}). "
        f"Build it against the installed torch with `{_REBUILD}`."
    ) from _e


def _version_triple(version: str) -> Optional[Tuple[int, int, int]]:
    m = re.match(r"\s*(\d+)\.(\d+)\.(\d+)", version)
    return tuple(int(x) for x in m.groups()) if m else None  # type: ignore[return-value]


def _check_torch_version() -> None:
    built = getattr(_C, "TORCH_VERSION", "?")
    if _version_triple(built) is None or _version_triple(built) != _version_triple(
        torch.__version__
    ):
        raise ImportError(
            f"torch_afdep._C was compiled against torch {built} but torch "
            f"{torch.__version__} is installed; C++ backends break across torch versions. "
            f"Rebuild it with `{_REBUILD}`."
        )


_check_torch_version()

#: The name to pass as ``backend=`` (``init_process_group``, ``new_group``).
BACKEND_NAME = "afdep"

#: Environment variable with the roles of afdep groups created without ``AfdepOptions``.
ROLES_ENV = "AFDEP_ROLES"

AfdepBackend = _C.AfdepBackend

RolesSpec = Union[str, Sequence[str]]

_lock = threading.Lock()
_roles_by_group: Dict[str, Tuple[str, ...]] = {}


def _parse_role_spec(spec: RolesSpec) -> Tuple[str, ...]:
    """Roles in any spelling ``torch_afdep.parse_roles`` takes; at least one rank."""
    roles = parse_roles(spec)
    if not roles:
        raise ValueError("roles must name at least one rank")
    return roles


def default_roles(size: int) -> Tuple[str, ...]:
    """The documented default layout of a group of ``size`` ranks: ``F = max(1, size // 2)``
    FFN ranks first, then ``size - F`` Attention ranks."""
    if size < 1:
        raise ValueError(f"group size must be positive, got {size}")
    f = max(1, size // 2)
    return (FFN,) * f + (ATTENTION,) * (size - f)


class AfdepOptions:
    """``pg_options`` of an afdep group.

    Arguments:
        roles: role of every group rank: a sequence of ``"attention"`` / ``"ffn"`` or a string
            such as ``"FFAA"``. ``None``: ``AFDEP_ROLES`` or the default layout.
        nccl_options: ``ProcessGroupNCCL.Options`` for the CUDA inner backend (copied; its
            timeout, group name and ranks are set from the group). ``None``: defaults.
    """

    def __init__(self, roles: Optional[RolesSpec] = None, nccl_options: Any = None) -> None:
        self.roles: Optional[Tuple[str, ...]] = (
            None if roles is None else _parse_role_spec(roles)
        )
        self.nccl_options = nccl_options

    def __repr__(self) -> str:
        return f"AfdepOptions(roles={self.roles!r}, nccl_options={self.nccl_options!r})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, AfdepOptions)
            and self.roles == other.roles
            and self.nccl_options is other.nccl_options
        )

    __hash__ = None  # type: ignore[assignment]


def resolve_roles(
    options: Optional[AfdepOptions],
    size: int,
    global_ranks: Sequence[int] = (),
    world_size: Optional[int] = None,
) -> Tuple[str, ...]:
    """The roles of a new afdep group of ``size`` ranks (see the module docstring).

    ``global_ranks``: the members' ranks in the default group (empty for the default group
    itself); ``world_size``: the default group's size (looked up when ``None``).
    """
    if options is not None and options.roles is not None:
        if len(options.roles) != size:
            raise ValueError(
                f"AfdepOptions.roles has {len(options.roles)} entries but the group has "
                f"{size} ranks"
            )
        return options.roles
    spec = afdep_env.get(ROLES_ENV).strip()
    if spec:
        try:
            roles = _parse_role_spec(spec)
        except ValueError as e:
            raise ValueError(f"{ROLES_ENV}={spec!r}: {e}") from e
        if len(roles) == size:
            return roles
        if global_ranks:
            if world_size is None and dist.is_initialized():
                world_size = dist.get_world_size()
            if world_size is not None and len(roles) == world_size:
                return tuple(roles[g] for g in global_ranks)
        raise ValueError(
            f"{ROLES_ENV}={spec!r} names {len(roles)} ranks, but the new afdep group has "
            f"{size} ranks (and is not a subgroup of a default group of {len(roles)} ranks); "
            f"pass pg_options=AfdepOptions(roles=...) for this group"
        )
    return default_roles(size)


def make_backend(rank: int, size: int, roles: Sequence[str], cpu_inner, cuda_inner=None):
    """``_C.AfdepBackend(rank, size, roles, cpu_inner, cuda_inner)``, raising ValueError on
    invalid arguments.

    Use this rather than the class itself: the C++ constructor never raises (an exception
    thrown out of it crashed the interpreter with torch 2.11's pybind11); an AfdepBackend
    built from invalid arguments raises ValueError on every use instead.
    """
    roles = list(roles)
    why = _C.invalid_reason(rank, size, roles, cpu_inner, cuda_inner)
    if why:
        raise ValueError(why)
    return _C.AfdepBackend(rank, size, roles, cpu_inner, cuda_inner)


def _as_options(backend_options: Any) -> AfdepOptions:
    if backend_options is None:
        return AfdepOptions()
    if isinstance(backend_options, AfdepOptions):
        return backend_options
    nccl_cls = getattr(dist, "ProcessGroupNCCL", None)
    if nccl_cls is not None and isinstance(backend_options, nccl_cls.Options):
        return AfdepOptions(nccl_options=backend_options)
    raise TypeError(
        "pg_options of an afdep group must be torch_afdep.distributed.AfdepOptions "
        f"(or ProcessGroupNCCL.Options), got {type(backend_options).__name__}"
    )


def _make_nccl(store, rank: int, size: int, timeout, group_name: str, global_ranks,
               options: AfdepOptions):
    nccl = dist.ProcessGroupNCCL
    if options.nccl_options is not None:
        opts = copy.deepcopy(options.nccl_options)
    else:
        opts = nccl.Options()
        opts.is_high_priority_stream = False
    opts._timeout = timeout
    opts.global_ranks_in_group = list(global_ranks)
    opts.group_name = group_name
    pg = nccl(dist.PrefixStore("afdep-nccl/", store), rank, size, opts)
    pg._set_sequence_number_for_group()
    return pg


def _give_new_group_a_backend_type(helper_frame) -> None:
    """Set the default backend type of the process group being created, where torch left it
    UNDEFINED.

    For a multi-device backend string ("cpu:gloo,cuda:afdep") torch's
    ``_new_process_group_helper`` looks for a custom backend by comparing the first plugin's
    name ("AFDEP", upper case) with the device map's values ("afdep"); they never match, the
    group keeps ``BackendType.UNDEFINED`` and ``destroy_process_group()`` prints "No backend of
    type 0 found ... (function hasHooks)" on every rank. ``_create`` runs inside that helper,
    whose local ``pg`` is the new group: give it CUSTOM, the type torch registers afdep under
    and meant to choose. Anything else (another caller, a type already set) is left alone."""
    if helper_frame is None or helper_frame.f_code.co_name != "_new_process_group_helper":
        return
    pg = helper_frame.f_locals.get("pg")
    if isinstance(pg, dist.ProcessGroup) and pg._get_backend_name() == "undefined":
        pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)


def _create(dist_backend_opts, backend_options) -> "AfdepBackend":
    """Creator registered with c10d (``extended_api=True``): one AfdepBackend per group and
    device type mapped to afdep. Runs on every member of the new group."""
    options = _as_options(backend_options)
    store = dist_backend_opts.store
    rank = int(dist_backend_opts.group_rank)
    size = int(dist_backend_opts.group_size)
    timeout = dist_backend_opts.timeout
    group_name = str(dist_backend_opts.group_id)
    global_ranks = [int(r) for r in dist_backend_opts.global_ranks_in_group]

    roles = resolve_roles(
        options, size, global_ranks, size if not global_ranks else None
    )

    cpu = dist.ProcessGroupGloo(dist.PrefixStore("afdep-gloo/", store), rank, size, timeout)
    try:
        cpu.options.global_ranks_in_group = global_ranks
        cpu.options.group_name = group_name
    except (AttributeError, TypeError):  # older bindings without these fields
        pass
    cpu._set_sequence_number_for_group()

    cuda = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        cuda = _make_nccl(store, rank, size, timeout, group_name, global_ranks, options)

    backend = make_backend(rank, size, roles, cpu, cuda)
    _give_new_group_a_backend_type(sys._getframe(1))
    with _lock:
        _roles_by_group[group_name] = tuple(roles)
    return backend


def is_registered() -> bool:
    """Whether c10d knows a backend called ``"afdep"``."""
    plugins = getattr(dist.Backend, "_plugins", {})
    return BACKEND_NAME.upper() in plugins or hasattr(dist.Backend, BACKEND_NAME.upper())


def register_backend() -> bool:
    """Register the ``"afdep"`` c10d backend; idempotent. Returns True when this call
    registered it, False when it was registered already."""
    with _lock:
        if is_registered():
            return False
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
        return True


def _resolve_group(group):
    """A ProcessGroup for ``group`` (a ProcessGroup, a group name or None = default group),
    or None where it cannot be found."""
    if group is None:
        return dist.group.WORLD if dist.is_initialized() else None
    if isinstance(group, str):
        resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)
        if resolve is None or not dist.is_initialized():
            return None
        try:
            return resolve(group)
        except Exception:
            return None
    return group


def _backends_of(group):
    """The per-device backends of ``group`` (debug wrappers unwrapped)."""
    found = []
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except Exception:
            continue
        wrapped = getattr(backend, "wrapped_pg", None)  # TORCH_DISTRIBUTED_DEBUG=DETAIL
        found.append(wrapped if wrapped is not None else backend)
    return found


def roles_of(group=None) -> Optional[Tuple[str, ...]]:
    """Roles of the ranks of ``group`` (a ProcessGroup, a group name, or ``None`` for the
    default group) when an afdep backend created it, else ``None``.

    Only members of ``group`` know its roles (the backend is created on members only).
    """
    pg = _resolve_group(group)
    backends = _backends_of(pg) if pg is not None else []
    for backend in backends:
        if isinstance(backend, _C.AfdepBackend):
            return tuple(backend.roles())
    if backends:
        return None  # the group's backends are known and none is afdep
    name = group if isinstance(group, str) else getattr(pg, "group_name", None)
    if not isinstance(name, str):
        return None
    with _lock:
        return _roles_by_group.get(name)


def afdep_backend(group=None, device: str = "cpu") -> Optional["AfdepBackend"]:
    """The AfdepBackend behind ``group`` (ProcessGroup, name or None = default group) for
    ``device``, or ``None``."""
    pg = _resolve_group(group)
    if pg is None:
        return None
    try:
        backend = pg._get_backend(torch.device(device))
    except Exception:
        return None
    backend = getattr(backend, "wrapped_pg", None) or backend
    return backend if isinstance(backend, _C.AfdepBackend) else None


__all__ = [
    "AfdepBackend", "AfdepOptions", "BACKEND_NAME", "ROLES_ENV", "afdep_backend",
    "default_roles", "is_registered", "make_backend", "register_backend", "resolve_roles", "roles_of",
]
