"""Per-role process groups, DeviceMeshes and expert sharding with DTensor.

An AFD deployment splits its ranks into FFN ranks (hold the experts) and Attention ranks
(route tokens). These helpers give each role its own process group and 1-D DeviceMesh, so
expert weights can be sharded over the FFN ranks with DTensor, matching the exchange's layout:
FFN index ``f`` owns the global experts ``[f*E/F, (f+1)*E/F)``.

``role_groups`` is collective over the default group: every rank must call it, with the same
arguments, because ``dist.new_group`` is.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ..config import ATTENTION, FFN, Config
from .backend import BACKEND_NAME, AfdepOptions, _parse_role_spec

RolesLike = Union[Config, str, Sequence[str]]


def _roles_from(config_or_roles: RolesLike) -> Tuple[str, ...]:
    if isinstance(config_or_roles, Config):
        return tuple(config_or_roles.role_list)
    return _parse_role_spec(config_or_roles)


def _uses_afdep(backend: Optional[str]) -> bool:
    """Whether ``new_group(backend=backend)`` makes an afdep group."""
    name = backend if backend else dist.get_backend()
    return BACKEND_NAME in str(name).lower()


@dataclasses.dataclass(frozen=True)
class RoleGroups:
    """The two role groups of one AFD layout, as seen from this rank.

    Attributes:
        roles: role of every rank of the layout, in layout order.
        ranks: global rank (in the default group) of each layout rank, ascending.
        ffn_ranks: global ranks of the FFN ranks; FFN index ``f`` is ``ffn_ranks[f]``.
        attention_ranks: global ranks of the Attention ranks; index ``a`` is
            ``attention_ranks[a]``.
        role: this rank's role, or ``None`` when it is not part of the layout.
        ffn_group: the process group of the FFN ranks; ``None`` on ranks outside it (and when
            there are no FFN ranks). Its group rank ``f`` is FFN index ``f``.
        attention_group: the same for the Attention ranks.
    """

    roles: Tuple[str, ...]
    ranks: Tuple[int, ...]
    ffn_ranks: Tuple[int, ...]
    attention_ranks: Tuple[int, ...]
    role: Optional[str]
    ffn_group: Optional[dist.ProcessGroup]
    attention_group: Optional[dist.ProcessGroup]

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The group of this rank's own role (``None`` outside the layout)."""
        if self.role == FFN:
            return self.ffn_group
        if self.role == ATTENTION:
            return self.attention_group
        return None

    @property
    def role_index(self) -> Optional[int]:
        """This rank's index among the ranks of its role (``f`` or ``a``), or ``None``."""
        me = dist.get_rank()
        members = self.ffn_ranks if self.role == FFN else self.attention_ranks
        return members.index(me) if self.role is not None else None


def role_groups(
    config_or_roles: RolesLike,
    backend: Optional[str] = None,
    *,
    ranks: Optional[Sequence[int]] = None,
    timeout=None,
) -> RoleGroups:
    """Create one process group per role. Collective: every rank of the default group calls
    it with the same arguments (ranks outside a group still take part in creating it).

    Arguments:
        config_or_roles: a ``Config`` (its ``role_list``), a list of ``"attention"``/``"ffn"``
            or a string such as ``"FFAA"``: one role per layout rank.
        backend: backend of the new groups; ``None``: the default group's. When it is an
            afdep backend the new groups get ``AfdepOptions`` naming their single role (the
            FFN group is all ``"ffn"``, the Attention group all ``"attention"``).
        ranks: global rank of each layout rank, strictly increasing (so that group rank
            order is layout order); ``None``: ``range(len(roles))``.
        timeout: passed to ``dist.new_group``.

    Returns:
        ``RoleGroups``; a role with no ranks gets no group (``None`` everywhere).
    """
    roles = _roles_from(config_or_roles)
    world = dist.get_world_size()
    ranks_t = tuple(range(len(roles))) if ranks is None else tuple(int(r) for r in ranks)
    if len(ranks_t) != len(roles):
        raise ValueError(f"ranks has {len(ranks_t)} entries but roles has {len(roles)}")
    if any(b <= a for a, b in zip(ranks_t, ranks_t[1:])):
        raise ValueError(f"ranks must be strictly increasing, got {list(ranks_t)}")
    if ranks_t and (ranks_t[0] < 0 or ranks_t[-1] >= world):
        raise ValueError(f"ranks {list(ranks_t)} fall outside the world of {world} ranks")

    ffn = tuple(g for g, r in zip(ranks_t, roles) if r == FFN)
    attn = tuple(g for g, r in zip(ranks_t, roles) if r == ATTENTION)
    afdep = _uses_afdep(backend)
    me = dist.get_rank()

    def make(members: Tuple[int, ...], role: str) -> Optional[dist.ProcessGroup]:
        if not members:  # new_group([]) would mean "every rank"
            return None
        opts = AfdepOptions(roles=(role,) * len(members)) if afdep else None
        kwargs = {} if timeout is None else {"timeout": timeout}
        group = dist.new_group(list(members), backend=backend, pg_options=opts, **kwargs)
        return group if me in members else None

    # Same order on every rank: new_group calls must match up.
    ffn_group = make(ffn, FFN)
    attention_group = make(attn, ATTENTION)
    role = roles[ranks_t.index(me)] if me in ranks_t else None
    return RoleGroups(roles, ranks_t, ffn, attn, role, ffn_group, attention_group)


@dataclasses.dataclass(frozen=True)
class RoleMeshes:
    """1-D DeviceMeshes over the role groups, as seen from this rank.

    Only the mesh of this rank's own role is built (the other is ``None``):
    ``DeviceMesh.from_group`` needs the group's ranks, which only members know, and a rank
    outside a mesh has no coordinate in it, so DTensors on it would hold no data there.

    Attributes:
        groups: the ``RoleGroups`` the meshes were built from.
        ffn_mesh: mesh over the FFN ranks (dim name ``"ffn"``); its coordinate is the FFN index
            ``f``. ``None`` on Attention ranks.
        attention_mesh: mesh over the Attention ranks (dim name ``"attention"``). ``None`` on
            FFN ranks.
    """

    groups: RoleGroups
    ffn_mesh: Optional[DeviceMesh]
    attention_mesh: Optional[DeviceMesh]

    @property
    def role(self) -> Optional[str]:
        return self.groups.role

    @property
    def mesh(self) -> Optional[DeviceMesh]:
        """The mesh of this rank's own role."""
        return self.ffn_mesh if self.role == FFN else self.attention_mesh


def role_meshes(
    config_or_roles: RolesLike,
    device_type: str = "cpu",
    backend: Optional[str] = None,
    *,
    ranks: Optional[Sequence[int]] = None,
    groups: Optional[RoleGroups] = None,
) -> RoleMeshes:
    """Build the DeviceMesh of this rank's role with ``DeviceMesh.from_group``.

    Collective when ``groups`` is ``None`` (it calls ``role_groups``, same arguments on every
    rank). With ``groups`` given (from ``role_groups``) it only builds the mesh locally.

    Arguments:
        config_or_roles, backend, ranks: as for ``role_groups``.
        device_type: ``"cpu"`` or ``"cuda"``, the device type of the meshes (no index).
        groups: reuse existing role groups instead of creating new ones.
    """
    if groups is None:
        groups = role_groups(config_or_roles, backend, ranks=ranks)
    elif groups.roles != _roles_from(config_or_roles):
        raise ValueError(
            f"groups were made for roles {groups.roles}, not {_roles_from(config_or_roles)}"
        )
    mine = groups.group
    mesh = None
    if mine is not None:
        mesh = DeviceMesh.from_group(mine, device_type, mesh_dim_names=(groups.role,))
    return RoleMeshes(
        groups=groups,
        ffn_mesh=mesh if groups.role == FFN else None,
        attention_mesh=mesh if groups.role == ATTENTION else None,
    )


def shard_experts(
    weight: torch.Tensor, ffn_mesh: DeviceMesh, *, src_data_rank: Optional[int] = 0
) -> DTensor:
    """Shard stacked expert weights over the FFN ranks: ``distribute_tensor(weight, ffn_mesh,
    [Shard(0)])``. Collective over ``ffn_mesh`` (call it on FFN ranks only).

    Arguments:
        weight: ``[E, *rest]``, any dtype: one slice per global expert, in global expert
            order, e.g. ``[E, H, I]`` bfloat16. ``E`` must be a multiple of the mesh size F.
            On the mesh's device type or CPU (moved to the mesh's device type).
        ffn_mesh: the 1-D FFN mesh (``role_meshes(...).ffn_mesh``).
        src_data_rank: mesh rank whose ``weight`` is scattered (default 0, so the other
            ranks' values are ignored); ``None``: every rank keeps its own slice of its own
            ``weight`` (no communication).

    Returns:
        DTensor of global shape ``[E, *rest]`` (same dtype); on FFN index ``f`` its local
        tensor is ``[E/F, *rest]`` = ``weight[f*E/F:(f+1)*E/F]``, the experts ``f`` owns.
    """
    if ffn_mesh.ndim != 1:
        raise ValueError(f"ffn_mesh must be 1-D, got a {ffn_mesh.ndim}-D mesh")
    if weight.dim() < 1:
        raise ValueError("weight must have an expert dimension (dim 0)")
    f = ffn_mesh.size()
    if weight.shape[0] % f != 0:
        raise ValueError(
            f"weight has {weight.shape[0]} experts, not a multiple of the {f} FFN ranks: "
            f"each FFN rank owns num_experts/ffn_ranks experts"
        )
    return distribute_tensor(weight, ffn_mesh, [Shard(0)], src_data_rank=src_data_rank)


def local_experts(dtensor: DTensor) -> torch.Tensor:
    """This FFN rank's experts of a ``shard_experts`` DTensor.

    Arguments:
        dtensor: DTensor of global shape ``[E, *rest]`` placed ``[Shard(0)]`` on a 1-D mesh.

    Returns:
        Tensor ``[E/F, *rest]`` (dtype and device of the DTensor's local shard): the global
        experts ``[f*E/F, (f+1)*E/F)`` in order, where ``f`` is this rank's mesh coordinate.
    """
    if not isinstance(dtensor, DTensor):
        raise TypeError(f"expected a DTensor, got {type(dtensor).__name__}")
    if tuple(dtensor.placements) != (Shard(0),):
        raise ValueError(f"expected placements [Shard(0)], got {list(dtensor.placements)}")
    return dtensor.to_local()


__all__ = ["RoleGroups", "RoleMeshes", "role_groups", "role_meshes", "shard_experts",
           "local_experts"]
