"""torch.distributed integration of torch_afdep.

- ``backend``: the ``"afdep"`` c10d backend (``register_backend``, ``AfdepOptions``,
  ``roles_of``).
- ``mesh``: per-role process groups, DeviceMeshes and expert sharding with DTensor
  (``role_groups``, ``role_meshes``, ``shard_experts``, ``local_experts``). Imported on first
  use, since ``torch.distributed.tensor`` is slow to import.
"""

from .backend import (
    BACKEND_NAME,
    ROLES_ENV,
    AfdepBackend,
    AfdepOptions,
    afdep_backend,
    default_roles,
    is_registered,
    make_backend,
    register_backend,
    resolve_roles,
    roles_of,
)

_MESH_NAMES = ("RoleGroups", "RoleMeshes", "role_groups", "role_meshes", "shard_experts",
               "local_experts")


def __getattr__(name):
    if name in _MESH_NAMES:
        from . import mesh

        return getattr(mesh, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKEND_NAME", "ROLES_ENV", "AfdepBackend", "AfdepOptions", "afdep_backend",
    "default_roles", "is_registered", "make_backend", "register_backend", "resolve_roles", "roles_of",
    *_MESH_NAMES,
]
