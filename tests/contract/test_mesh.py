"""Role groups, role DeviceMeshes and expert sharding with DTensor, on real processes."""

import pytest
import torch
import torch.distributed as dist

import torch_afdep.distributed as ad
from torch_afdep.config import Config
from torch_afdep.testing import spawn_world

from tests.helpers.devices import need_gpus

ad.register_backend()  # also runs in spawned children, which import this module

F, A = "ffn", "attention"
E, ROWS, COLS = 8, 4, 6


def _weight(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, ROWS, COLS, generator=g, dtype=torch.float32)


def _check_layout(rank, ws, rm, roles, backend_is_afdep):
    from torch.distributed.tensor import DTensor, Shard

    rg = rm.groups
    ffn = tuple(r for r in range(ws) if roles[r] == F)
    attn = tuple(r for r in range(ws) if roles[r] == A)
    assert rg.roles == roles and rg.ffn_ranks == ffn and rg.attention_ranks == attn
    assert rg.role == roles[rank] and rm.role == roles[rank]
    mine = ffn if rg.role == F else attn
    assert rg.role_index == mine.index(rank)
    other_group = rg.attention_group if rg.role == F else rg.ffn_group
    assert rg.group is not None and other_group is None
    assert dist.get_process_group_ranks(rg.group) == list(mine)
    if backend_is_afdep:
        assert ad.roles_of(rg.group) == (rg.role,) * len(mine)
    else:
        assert ad.roles_of(rg.group) is None

    # a collective on the role group reaches exactly the ranks of that role
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=rg.group)
    assert t.item() == float(sum(mine))

    mesh = rm.mesh
    assert mesh is not None and mesh.device_type == "cpu"
    assert mesh.mesh.tolist() == list(mine)
    assert mesh.mesh_dim_names == (rg.role,)
    assert mesh.get_local_rank() == mine.index(rank)
    if rg.role == A:
        assert rm.ffn_mesh is None and rm.attention_mesh is mesh
        return
    assert rm.attention_mesh is None and rm.ffn_mesh is mesh

    # every rank holds a different weight; distribute_tensor scatters FFN index 0's
    f, nf = mine.index(rank), len(mine)
    truth = _weight(ffn[0])
    dt = ad.shard_experts(_weight(rank), mesh)
    assert isinstance(dt, DTensor) and tuple(dt.placements) == (Shard(0),)
    assert dt.shape == (E, ROWS, COLS) and dt.dtype == torch.float32
    local = ad.local_experts(dt)
    per = E // nf
    assert local.shape == (per, ROWS, COLS)
    assert torch.equal(local, truth[f * per:(f + 1) * per])
    assert torch.equal(dt.full_tensor(), truth)

    # src_data_rank=None: each rank keeps its own slice, no scatter
    own = ad.local_experts(ad.shard_experts(_weight(rank), mesh, src_data_rank=None))
    assert torch.equal(own, _weight(rank)[f * per:(f + 1) * per])

    # bf16 expert weights keep their dtype
    wb = truth.to(torch.bfloat16)
    lb = ad.local_experts(ad.shard_experts(wb, mesh))
    assert lb.dtype == torch.bfloat16 and torch.equal(lb, wb[f * per:(f + 1) * per])

    try:
        ad.shard_experts(torch.zeros(E - 1, 2), mesh)
    except ValueError as e:
        assert "multiple" in str(e)
    else:
        raise AssertionError("uneven expert count was accepted")
    try:
        ad.local_experts(torch.zeros(2))
    except TypeError:
        pass
    else:
        raise AssertionError("a plain tensor was accepted")


def _mesh_body(rank, ws):
    # 1. default layout from a Config, on the default afdep backend
    cfg = Config(capacity_tokens_per_rank=4, hidden_size=8, num_experts=E, top_k=2,
                 ffn_ranks=2, attention_ranks=2)
    rg = ad.role_groups(cfg)
    rm = ad.role_meshes(cfg, groups=rg)
    _check_layout(rank, ws, rm, (F, F, A, A), backend_is_afdep=True)

    # 2. interleaved roles given as a string, groups on gloo, meshes made in one call
    rm = ad.role_meshes("AFAF", "cpu", backend="gloo")
    _check_layout(rank, ws, rm, (A, F, A, F), backend_is_afdep=False)

    # 3. three FFN ranks, one Attention rank, explicit afdep backend
    cfg3 = Config(capacity_tokens_per_rank=4, hidden_size=8, num_experts=6, top_k=2,
                  ffn_ranks=3, attention_ranks=1, roles=(F, A, F, F))
    rm = ad.role_meshes(cfg3, backend="afdep")
    if rm.role == F:
        f = (0, None, 1, 2)[rank]
        w = torch.arange(6 * 2, dtype=torch.float32).reshape(6, 2)
        local = ad.local_experts(ad.shard_experts(w, rm.ffn_mesh))
        assert torch.equal(local, w[2 * f:2 * f + 2])
    else:
        assert rm.groups.role_index == 0 and rm.mesh.size() == 1

    # 4. argument checks (raised before any group is made, alike on every rank) and a
    # sub-layout over global rank 1 only: one FFN rank, no Attention ranks
    for bad, ranks, msg in (((F, A, F), [0, 1], "ranks has"), ("FA", [1, 0], "increasing"),
                            ("FA", [3, 4], "outside")):
        try:
            ad.role_groups(bad, ranks=ranks)
        except ValueError as e:
            assert msg in str(e), e
        else:
            raise AssertionError(f"role_groups accepted {bad} {ranks}")
    rg = ad.role_groups("F", ranks=[1])
    assert rg.attention_group is None and rg.attention_ranks == ()
    assert (rg.ffn_group is not None) == (rank == 1)
    assert rg.role == (F if rank == 1 else None) and (rg.group is None) == (rank != 1)
    dist.barrier()
    return rank


def test_role_meshes_and_expert_sharding_4_ranks():
    assert spawn_world(_mesh_body, 4, backend="afdep", timeout=120) == [0, 1, 2, 3]


def _cuda_mesh_body(rank, ws):
    rm = ad.role_meshes("FF", "cuda")
    assert rm.ffn_mesh is not None and rm.ffn_mesh.device_type == "cuda"
    w = _weight(0).cuda()
    local = ad.local_experts(ad.shard_experts(w, rm.ffn_mesh))
    assert local.is_cuda and torch.equal(local, w[4 * rank:4 * rank + 4])
    torch.cuda.synchronize()
    return True


@pytest.mark.gpu
@need_gpus(2, "NCCL takes one rank per GPU")
def test_cuda_mesh_2_gpus():
    out = spawn_world(_cuda_mesh_body, 2, backend="afdep", device_ids=[0, 1], timeout=240)
    assert out == [True, True]
