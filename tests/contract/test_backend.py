"""The "afdep" c10d backend: registration, roles, and collectives delegated to gloo.

Spawned worlds are slow on small machines, so each spawned function runs many checks.
"""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torch_afdep.distributed as ad
from torch_afdep import _C
from torch_afdep.distributed import backend as backend_mod
from torch_afdep.testing import spawn_world

from tests.helpers.devices import need_gpus

ad.register_backend()  # also runs in spawned children, which import this module

F, A = "ffn", "attention"


def _cpu_backend(group=None):
    group = group or dist.group.WORLD
    return group._get_backend(torch.device("cpu"))


# ---- in-process --------------------------------------------------------------------------


def test_registration_is_idempotent():
    assert ad.is_registered()
    assert ad.register_backend() is False
    assert ad.register_backend() is False
    assert dist.Backend("afdep") == "afdep"
    assert dist.Backend.backend_capability["afdep"] == ["cpu", "cuda"]
    assert dist.Backend._plugins["AFDEP"].extended_api is True
    # the defaults of other device types are untouched
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"


def test_torch_version_check(monkeypatch):
    triple = backend_mod._version_triple
    assert triple(_C.TORCH_VERSION) == triple(torch.__version__)
    backend_mod._check_torch_version()
    monkeypatch.setattr(_C, "TORCH_VERSION", "1.0.0")
    with pytest.raises(ImportError, match="pip install --no-build-isolation --no-deps -e ."):
        backend_mod._check_torch_version()


def test_options_and_default_roles():
    assert ad.AfdepOptions(roles="ffaA").roles == (F, F, A, A)
    assert ad.AfdepOptions(roles=[A, F]).roles == (A, F)
    assert ad.AfdepOptions(roles="ffn, attention").roles == (F, A)
    assert ad.AfdepOptions().roles is None
    with pytest.raises(ValueError):
        ad.AfdepOptions(roles="FXA")
    with pytest.raises(ValueError):
        ad.AfdepOptions(roles=["ffn", "expert"])
    assert ad.default_roles(1) == (F,)
    assert ad.default_roles(2) == (F, A)
    assert ad.default_roles(5) == (F, F, A, A, A)


def test_resolve_roles(monkeypatch):
    monkeypatch.delenv("AFDEP_ROLES", raising=False)
    assert ad.resolve_roles(None, 3) == (F, A, A)
    assert ad.resolve_roles(ad.AfdepOptions(roles="AAF"), 3) == (A, A, F)
    with pytest.raises(ValueError, match="3 ranks"):
        ad.resolve_roles(ad.AfdepOptions(roles="AF"), 3)
    monkeypatch.setenv("AFDEP_ROLES", "AFAF")
    assert ad.resolve_roles(None, 4) == (A, F, A, F)
    # options win over the environment
    assert ad.resolve_roles(ad.AfdepOptions(roles="FFFA"), 4) == (F, F, F, A)
    # a subgroup of the default group takes the entries of its global ranks
    assert ad.resolve_roles(None, 2, global_ranks=[1, 3], world_size=4) == (F, F)
    assert ad.resolve_roles(None, 3, global_ranks=[0, 1, 2], world_size=4) == (A, F, A)
    with pytest.raises(ValueError, match="AFDEP_ROLES"):
        ad.resolve_roles(None, 3)


def test_backend_object_in_process():
    store = dist.HashStore()
    gloo = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=30))
    b = ad.make_backend(0, 1, ["attention"], gloo)
    assert isinstance(b, torch._C._distributed_c10d.Backend)
    assert b.name() == "afdep"
    assert b.roles() == ["attention"] and b.role() == "attention"
    assert b.cpu_inner() is gloo and b.cuda_inner() is None
    assert b.rank() == 0 and b.size() == 1
    assert not b.supports_coalescing  # only a CUDA inner (NCCL) coalesces
    t = torch.arange(4.0)
    b.allreduce([t]).wait()
    assert torch.equal(t, torch.arange(4.0))

    # a coalescing block of CPU ops: one Work that waits on every op
    b._start_coalescing()
    x, y = torch.ones(2), torch.full((3,), 2.0)
    b.allreduce([x])
    b.broadcast([y])
    work = b._end_coalescing()
    assert work is not None and work.wait()
    assert torch.equal(x, torch.ones(2)) and torch.equal(y, torch.full((3,), 2.0))
    b._start_coalescing()
    assert b._end_coalescing() is None  # nothing was coalesced
    with pytest.raises(RuntimeError, match="without startCoalescing"):
        b._end_coalescing()

    with pytest.raises(ValueError, match="roles has 2 entries"):
        ad.make_backend(0, 1, ["ffn", "ffn"], gloo)
    with pytest.raises(ValueError, match="must be 'attention' or 'ffn'"):
        ad.make_backend(0, 1, ["expert"], gloo)
    with pytest.raises(ValueError, match="inner backend is rank 0 of 1"):
        ad.make_backend(1, 2, ["ffn", "attention"], gloo)
    assert _C.invalid_reason(0, 1, ["ffn"], gloo) == ""
    # the class itself never raises in its constructor; an invalid one raises on use
    bad = _C.AfdepBackend(0, 1, ["ffn", "ffn"], gloo)
    with pytest.raises(ValueError, match="roles has 2 entries"):
        bad.check()
    with pytest.raises(ValueError, match="roles has 2 entries"):
        bad.allreduce([torch.ones(1)])
    with pytest.raises(ValueError, match="roles has 2 entries"):
        bad.role()
    b.check()


def test_bad_pg_options_type():
    with pytest.raises(TypeError, match="AfdepOptions"):
        backend_mod._as_options(object())


# ---- spawned worlds ----------------------------------------------------------------------


def _collectives_body(rank, ws):
    """4 ranks, backend="afdep", no AFDEP_ROLES: default roles, every delegated collective."""
    assert dist.get_backend() == "afdep"
    world = dist.group.WORLD
    b = _cpu_backend()
    assert isinstance(b, ad.AfdepBackend) and b.name() == "afdep"
    assert world._get_backend(torch.device("cuda")) is not None  # one backend for both
    assert tuple(b.roles()) == (F, F, A, A) and b.role() == (F if rank < 2 else A)
    assert ad.roles_of() == (F, F, A, A)
    assert ad.roles_of(world) == (F, F, A, A)
    assert ad.roles_of(world.group_name) == (F, F, A, A)
    assert ad.afdep_backend() is not None
    assert type(b.cpu_inner()).__name__ == "ProcessGroupGloo"
    assert (b.cuda_inner() is None) == (not torch.cuda.is_available())

    # all_reduce (sum, max)
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((5,), 10.0))
    t = torch.tensor([rank, -rank], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.tolist() == [3, 0]

    # broadcast from rank 2
    t = torch.arange(6, dtype=torch.float32) * (rank + 1)
    dist.broadcast(t, src=2)
    assert torch.equal(t, torch.arange(6, dtype=torch.float32) * 3)

    # reduce to rank 1
    t = torch.full((2,), float(rank))
    dist.reduce(t, dst=1)
    if rank == 1:
        assert t.tolist() == [6.0, 6.0]

    # all_gather_into_tensor and all_gather (list)
    out = torch.empty(2 * ws, dtype=torch.int32)
    dist.all_gather_into_tensor(out, torch.full((2,), rank, dtype=torch.int32))
    assert out.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    outs = [torch.empty(3) for _ in range(ws)]
    dist.all_gather(outs, torch.full((3,), rank * 1.5))
    assert [o[0].item() for o in outs] == [0.0, 1.5, 3.0, 4.5]

    # reduce_scatter_tensor: sum over ranks of (arange + 100 * rank) = 4 * arange + 600
    inp = torch.arange(4 * ws, dtype=torch.float64) + 100 * rank
    out = torch.empty(4, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, inp)
    expect = (4 * torch.arange(4 * ws, dtype=torch.float64) + 600)[4 * rank:4 * rank + 4]
    assert torch.equal(out, expect)

    # all_to_all_single, even and uneven splits
    inp = torch.tensor([rank * 10 + j for j in range(ws)], dtype=torch.int64)
    out = torch.empty(ws, dtype=torch.int64)
    dist.all_to_all_single(out, inp)
    assert out.tolist() == [j * 10 + rank for j in range(ws)]
    inp = torch.cat([torch.full((j + 1,), rank * 10 + j) for j in range(ws)]).float()
    out = torch.empty(ws * (rank + 1))
    dist.all_to_all_single(out, inp, output_split_sizes=[rank + 1] * ws,
                           input_split_sizes=[j + 1 for j in range(ws)])
    assert out.tolist() == [float(j * 10 + rank) for j in range(ws) for _ in range(rank + 1)]

    # gather / scatter
    gl = [torch.empty(1) for _ in range(ws)] if rank == 0 else None
    dist.gather(torch.tensor([rank + 0.5]), gl, dst=0)
    if rank == 0:
        assert [g.item() for g in gl] == [0.5, 1.5, 2.5, 3.5]
    got = torch.empty(2)
    sl = [torch.full((2,), 7.0 * r) for r in range(ws)] if rank == 3 else None
    dist.scatter(got, sl, src=3)
    assert got.tolist() == [7.0 * rank] * 2

    # send / recv around a ring, and the batched form
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    got = torch.empty(3)
    reqs = [dist.isend(torch.full((3,), float(rank)), nxt), dist.irecv(got, prv)]
    for r in reqs:
        r.wait()
    assert got.tolist() == [float(prv)] * 3
    got = torch.empty(2, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, torch.tensor([rank, rank * rank]), prv),
           dist.P2POp(dist.irecv, got, nxt)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    assert got.tolist() == [nxt, nxt * nxt]
    if rank in (0, 1):  # blocking send/recv between a pair
        if rank == 0:
            dist.send(torch.tensor([42.0]), 1)
        else:
            r = torch.empty(1)
            dist.recv(r, 0)
            assert r.item() == 42.0

    dist.barrier()

    # functional collective (the c10d_functional ops resolve the group by name)
    t = torch.full((3,), float(rank))
    r = funcol.all_reduce(t, "sum", world)
    assert torch.equal(funcol.wait_tensor(r), torch.full((3,), 6.0))
    r = funcol.all_gather_tensor(torch.tensor([rank]), 0, world)
    assert funcol.wait_tensor(r).tolist() == [0, 1, 2, 3]

    # subgroups: explicit roles from pg_options, default roles, and a non-afdep group
    g = dist.new_group([0, 1, 2], backend="afdep", pg_options=ad.AfdepOptions(roles="AFA"))
    g2 = dist.new_group([1, 3])  # default backend (afdep), default roles for 2 ranks
    g3 = dist.new_group([0, 1, 2, 3], backend="gloo")
    if rank < 3:
        assert ad.roles_of(g) == (A, F, A)
        assert _cpu_backend(g).role() == (A, F, A)[rank]
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g)
        assert t.item() == 3.0
    else:
        assert ad.roles_of(g) is None
    if rank in (1, 3):
        assert ad.roles_of(g2) == (F, A)
        t = torch.tensor([rank])
        dist.all_reduce(t, group=g2)
        assert t.item() == 4
    assert ad.roles_of(g3) is None

    # roles that do not fit the group fail on every member alike
    try:
        dist.new_group([0, 1, 2, 3], backend="afdep", pg_options=ad.AfdepOptions(roles="FF"))
    except ValueError as e:
        assert "2 entries but the group has 4 ranks" in str(e)
    else:
        raise AssertionError("mismatched roles were accepted")
    dist.barrier()
    return rank


def test_afdep_collectives_4_ranks():
    assert spawn_world(_collectives_body, 4, backend="afdep", timeout=120) == [0, 1, 2, 3]


def _mixed_body(rank, ws):
    """2 ranks, "cpu:gloo,cuda:afdep", AFDEP_ROLES=AF: the afdep creator runs for the cuda
    slot even without CUDA, and takes its roles from the environment."""
    world = dist.group.WORLD
    assert dist.get_backend() == "cpu:gloo,cuda:afdep"
    assert type(_cpu_backend()).__name__ == "ProcessGroupGloo"
    b = world._get_backend(torch.device("cuda"))
    assert isinstance(b, ad.AfdepBackend)
    assert tuple(b.roles()) == (A, F) and b.role() == (A, F)[rank]
    assert (b.cuda_inner() is None) == (not torch.cuda.is_available())
    assert ad.roles_of() == (A, F)
    assert ad.afdep_backend(device="cuda") is not None and ad.afdep_backend() is None

    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)  # CPU tensor: the group's gloo
    assert t.tolist() == [3.0, 3.0]
    t = torch.full((2,), float(rank + 1))
    b.allreduce([t]).wait()  # the afdep backend itself, on its CPU inner
    assert t.tolist() == [3.0, 3.0]

    sub = dist.new_group([1], backend="afdep")  # AFDEP_ROLES names the world: take rank 1's
    if rank == 1:
        assert ad.roles_of(sub) == (F,)
    full = dist.new_group([0, 1], backend="afdep")
    assert ad.roles_of(full) == (A, F)
    t = torch.tensor([rank + 1])
    dist.all_reduce(t, group=full)
    assert t.item() == 3
    dist.barrier(group=full)
    return True


def test_mixed_backend_string_and_env_roles():
    out = spawn_world(_mixed_body, 2, backend="cpu:gloo,cuda:afdep", timeout=120,
                      env={"AFDEP_ROLES": "AF"})
    assert out == [True, True]


# ---- CUDA inner (NCCL): skipped without 2 GPUs ---------------------------------------------


def _nccl_body(rank, ws, port):
    """2 ranks, one GPU each, backend="afdep": CUDA tensors go to the NCCL inner, CPU tensors
    to gloo; then the group is re-made as "cpu:gloo,cuda:afdep" with a bound device."""
    dev = torch.device("cuda", rank)
    world = dist.group.WORLD
    b = _cpu_backend()
    assert type(b.cuda_inner()).__name__ == "ProcessGroupNCCL"
    assert b.supports_coalescing
    other = 1 - rank

    t = torch.full((4,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4
    t = torch.arange(3, device=dev) * (rank + 1)
    dist.broadcast(t, src=1)
    assert t.tolist() == [0, 2, 4]
    out = torch.empty(4, device=dev, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, torch.full((2,), rank + 1.0, device=dev,
                                                dtype=torch.bfloat16))
    assert out.float().tolist() == [1.0, 1.0, 2.0, 2.0]
    out = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(out, torch.arange(4.0, device=dev) + rank)
    assert out.tolist() == [2 * (2 * rank) + 1.0, 2 * (2 * rank + 1) + 1.0]
    out = torch.empty(2, device=dev, dtype=torch.int64)
    dist.all_to_all_single(out, torch.tensor([rank * 10, rank * 10 + 1], device=dev))
    assert out.tolist() == [rank, 10 + rank]
    # unbatched NCCL p2p runs in issue order on one stream: if both ranks sent first, each
    # send kernel would wait for a receive queued behind the peer's send (run 19 hung here)
    got = torch.empty(3, device=dev)
    ops = [lambda: dist.isend(torch.full((3,), rank + 5.0, device=dev), other),
           lambda: dist.irecv(got, other)]
    for op in (ops if rank == 0 else ops[::-1]):
        op().wait()
    assert got.tolist() == [other + 5.0] * 3
    # batched p2p: coalesced by NCCL for CUDA tensors, run on gloo for CPU tensors
    for device in (dev, torch.device("cpu")):
        got = torch.empty(2, device=device)
        ops = [dist.P2POp(dist.isend, torch.tensor([rank, -rank], device=device).float(),
                          other),
               dist.P2POp(dist.irecv, got, other)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        assert got.tolist() == [other, -other], (device, got)
    t = torch.full((2,), float(rank), device=dev)
    assert funcol.wait_tensor(funcol.all_reduce(t, "sum", world)).tolist() == [1.0, 1.0]
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [3.0, 3.0]
    dist.barrier()  # no bound device: gloo
    dist.barrier(device_ids=[rank])  # named device: NCCL
    torch.cuda.synchronize()

    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, ws, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("cpu:gloo,cuda:afdep", store=store, rank=rank, world_size=ws,
                            device_id=dev, pg_options=ad.AfdepOptions(roles="AF"))
    world = dist.group.WORLD
    b = world._get_backend(torch.device("cuda"))
    assert isinstance(b, ad.AfdepBackend) and ad.roles_of() == (A, F)
    t = torch.full((4,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4
    dist.barrier()  # bound CUDA device: NCCL
    g = dist.new_group([0, 1], backend="afdep", pg_options=ad.AfdepOptions(roles="FA"))
    t = torch.full((2,), float(rank), device=dev)
    dist.all_reduce(t, group=g)
    assert t.tolist() == [1.0, 1.0] and ad.roles_of(g) == (F, A)
    torch.cuda.synchronize()
    return True


@pytest.mark.gpu
@need_gpus(2, "NCCL takes one rank per GPU")
def test_nccl_inner_2_gpus():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = spawn_world(_nccl_body, 2, port, backend="afdep", device_ids=[0, 1], timeout=240)
    assert out == [True, True]
