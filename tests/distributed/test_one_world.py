"""One world with torch's: ``import gpucomm as dist`` runs a torch.distributed script's torch
stack (DDP, FSDP2, DTensor, DeviceMesh, comm hooks) after ``dist.init_process_group()`` alone,
both APIs see the same groups, and the calls gpucomm added for torch's names work.

One spawn per world size runs every check (2 ranks: the training checks and the new calls;
4 ranks: the new calls, with a 2 x 2 DeviceMesh), on the default CPU path (the shared-memory
workspace). No ``from __future__ import annotations`` here: DDP compares a comm hook's
annotations with ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects,
which is what the hook below checks of ``gpucomm.GradBucket``.
"""

import datetime
import os

import pytest
import torch
import torch.distributed as tdist
from checks import Checks
from spawn import run_ranks

import gpucomm as dist

STEPS = 3


# A DDP comm hook as torch's tutorials write it, against ``import gpucomm as dist``.
def allreduce_mean_hook(
    process_group: dist.ProcessGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer().div_(dist.get_world_size(group))
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _train_ddp(rank: int, process_group=None, hook=None) -> dict[str, torch.Tensor]:
    """A plain DDP script: ``DDP(model)`` after ``dist.init_process_group()``, trained a few steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(9, 13), torch.nn.ReLU(), torch.nn.Linear(13, 3)),
        process_group=process_group,
    )
    if hook is not None:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own samples
    for _ in range(STEPS):
        model(torch.randn(8, 9, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.module.named_parameters()}


def _fsdp2_and_dtensor(c: Checks, rank: int, P: int) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 11), torch.nn.ReLU(), torch.nn.Linear(11, 5))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(20 + rank)
    for _ in range(STEPS):
        model(torch.randn(4, 7, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    c.expect(
        model[0].weight.to_local().shape[0] == 11 // P + (rank < 11 % P),
        f"FSDP2 shard {model[0].weight.to_local().shape}",
    )
    mesh = dist.init_device_mesh("cpu", (P,))
    full = torch.arange(6.0 * P).reshape(3 * P, 2)
    x = distribute_tensor(full, mesh, [Shard(0)])
    c.expect(torch.equal(x.to_local(), full[3 * rank : 3 * rank + 3]), "DTensor Shard(0)")
    c.expect(torch.equal(x.redistribute(mesh, [Replicate()]).to_local(), full), "DTensor Shard -> Replicate")
    partial = DTensor.from_local(torch.full((2,), float(rank + 1)), mesh, [Partial()])
    c.expect(torch.equal(partial.full_tensor(), torch.full((2,), P * (P + 1) / 2)), "DTensor Partial -> full")
    return {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}


def _sum_of(ranks: list[int]) -> torch.Tensor:
    return torch.full((3,), float(sum(r + 1 for r in ranks)))


def _reduces_over(c: Checks, group, members: list[int], rank: int, what: str) -> None:
    """gpucomm's and torch's all_reduce on ``group`` both sum over exactly ``members``."""
    c.expect(
        tdist.get_process_group_ranks(group) == members,
        f"{what}: torch sees ranks {tdist.get_process_group_ranks(group)}, want {members}",
    )
    c.expect(
        dist.get_process_group_ranks(group) == members,
        f"{what}: gpucomm sees ranks {dist.get_process_group_ranks(group)}",
    )
    for label, api in (("gpucomm", dist), ("torch", tdist)):
        t = torch.full((3,), float(rank + 1))
        api.all_reduce(t, group=group)
        c.expect(
            torch.equal(t, _sum_of(members)),
            f"{what}: {label} all_reduce {t.tolist()}, want {_sum_of(members).tolist()}",
        )


def _new_calls(c: Checks, rank: int, P: int) -> None:
    """The calls gpucomm added for torch's names, on gpucomm's world."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    # shrink_group first: its group is made by the remaining ranks alone, under torch's hashed
    # name (ranks and the count of groups this rank knows), which must agree among them.
    whole = dist.new_group()
    if rank != P - 1:
        shrunk = dist.shrink_group([P - 1], group=whole)
        _reduces_over(c, shrunk, list(range(P - 1)), rank, "shrink_group")
    try:
        dist.shrink_group([P - 1])
        c.expect(False, "shrink_group of the default group must be refused")
    except dist.UnsupportedError as err:
        c.expect("default group cannot be shrunk" in str(err), str(err))
    # split_group: disjoint lists of the parent's group ranks; every rank gets its list's group
    half = P // 2
    halves = [list(range(half)), list(range(half, P))]
    mine = dist.split_group(split_ranks=halves)
    _reduces_over(c, mine, halves[rank >= half], rank, "split_group")
    c.expect(_resolve_process_group(mine.group_name) is mine, "split_group's group is registered in torch's world")
    only_first = dist.split_group(split_ranks=[[0]])
    c.expect((only_first is None) == (rank != 0), f"split_group [[0]] on rank {rank}: {only_first!r}")
    # DeviceMesh: a 2 x 2 mesh at 4 ranks (rows "tp", columns "dp"), one dimension at 2
    if P == 4:
        mesh = dist.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        _reduces_over(c, mesh.get_group("tp"), [2 * (rank // 2), 2 * (rank // 2) + 1], rank, "mesh tp")
        _reduces_over(c, mesh.get_group("dp"), [rank % 2, rank % 2 + 2], rank, "mesh dp")
        c.expect(
            isinstance(mesh, dist.DeviceMesh) and mesh.get_group("tp").name() == "gpucomm", "mesh groups are gpucomm's"
        )
    else:
        mesh = dist.init_device_mesh("cpu", (P,))
        _reduces_over(c, mesh.get_group(), list(range(P)), rank, "mesh")
    # the rest of the names
    c.expect(dist.get_node_local_rank() == int(os.environ["LOCAL_RANK"]), "get_node_local_rank from LOCAL_RANK")
    saved = os.environ.pop("LOCAL_RANK")
    try:
        c.expect(dist.get_node_local_rank() == rank, "get_node_local_rank from the default group's layout")
    finally:
        os.environ["LOCAL_RANK"] = saved
    c.expect(dist.get_backend_config() == "cpu:gpucomm,cuda:gpucomm", dist.get_backend_config())
    count = dist.get_pg_count()
    on_gloo = dist.new_group(backend="gloo")  # a gpucomm group whose calls all go through gloo
    c.expect(dist.get_pg_count() == count + 1, f"get_pg_count {count} -> {dist.get_pg_count()}")
    c.expect(
        dist.get_backend_config(on_gloo) == "cpu:gloo,cuda:gloo" and dist.get_backend(on_gloo) == "gloo",
        dist.get_backend_config(on_gloo),
    )
    c.expect(dist.is_backend_available("gpucomm") and not dist.is_mpi_available(), "is_backend_available")
    c.expect(dist.get_default_backend_for_device("cpu") == "gpucomm", "get_default_backend_for_device")
    dist.breakpoint(rank=P)  # no rank stops: every rank passes the barrier
    dist.breakpoint(rank=0, skip=1)  # skipped everywhere: the first call from this line
    if hasattr(torch.distributed, "record_comm"):  # torch 2.13's; 2.11 has none, nor then has gpucomm
        with dist.record_comm("one_world_check"):
            t = torch.ones(2)
            dist.all_reduce(t)
        c.expect(torch.equal(t, torch.full((2,), float(P))), "all_reduce inside record_comm")
    # a script's `except dist.DistBackendError` catches gpucomm's timeout
    pair = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))
    if rank == 0:  # rank 1 never joins: rank 0 times out
        try:
            dist.all_reduce(torch.ones(2), group=pair)
            c.expect(False, "all_reduce without its peer must time out")
        except dist.DistBackendError as err:
            c.expect(isinstance(err, dist.CommTimeoutError) and err.missing == [1], f"{type(err).__name__}: {err}")
    dist.barrier()


def _file_pair(url: str, **kwargs):
    """A rendezvous handler of a scheme of this test's own: a FileStore at the URL's path."""
    from urllib.parse import parse_qs, urlparse

    parsed = urlparse(url)
    query = {k: int(v[0]) for k, v in parse_qs(parsed.query).items()}
    yield tdist.FileStore(parsed.path, query["world_size"]), query["rank"], query["world_size"]


def _two_ranks(rank: int, world_size: int, tmp: str) -> dict:
    c = Checks(rank)
    res: dict = {}
    try:
        dist.all_reduce(torch.ones(1))
    except ValueError as err:  # torch's type for "not initialized"
        c.expect(isinstance(err, dist.NotInitializedError), type(err).__name__)
    dist.init_process_group()
    # one world: torch's default group is gpucomm's, wrapping gpucomm's default communicator
    c.expect(
        tdist.is_initialized() and tdist.get_backend() == "gpucomm", f"torch's default group: {tdist.get_backend()}"
    )
    c.expect(dist.group.WORLD is tdist.group.WORLD and isinstance(dist.group.WORLD, tdist.ProcessGroup), "group.WORLD")
    c.expect(tdist.group.WORLD.communicator is dist.get_default_communicator(), "one Communicator")
    res["ddp"] = _train_ddp(rank)
    res["ddp_new_group"] = _train_ddp(rank, process_group=dist.new_group([0, 1]))
    res["ddp_hook"] = _train_ddp(rank, hook=allreduce_mean_hook)
    res["fsdp2"] = _fsdp2_and_dtensor(c, rank, world_size)
    # groups made on one side are the other side's
    theirs = tdist.new_group([0, 1])
    ours = dist.new_group([0, 1])
    from torch.distributed.distributed_c10d import _resolve_process_group

    c.expect(_resolve_process_group(ours.group_name) is ours, "gpucomm's group is registered in torch's world")
    _reduces_over(c, theirs, [0, 1], rank, "torch's new_group")
    _reduces_over(c, ours, [0, 1], rank, "gpucomm's new_group")
    _new_calls(c, rank, world_size)
    # double initialisation: refused from either side
    try:
        dist.init_process_group()
        c.expect(False, "a second gpucomm init must be refused")
    except dist.GpucommError as err:
        c.expect("already initialized" in str(err), str(err))
    try:
        tdist.init_process_group("gloo")
        c.expect(False, "torch's init after gpucomm's must be refused")
    except ValueError as err:
        c.expect("twice" in str(err), str(err))
    # destroy from torch's side, init from torch's side: gpucomm follows
    tdist.destroy_process_group()
    c.expect(not dist.is_initialized() and dist.group.WORLD is None, "after torch's destroy")
    tdist.init_process_group("gpucomm")
    c.expect(dist.is_initialized() and dist.group.WORLD is tdist.group.WORLD, "after torch's init")
    _reduces_over(c, dist.group.WORLD, [0, 1], rank, "the world of torch's init")
    sub = dist.new_group([1])
    c.expect((sub == dist.GroupMember.NON_GROUP_MEMBER) == (rank == 0), f"new_group([1]) on rank {rank}: {sub!r}")
    dist.destroy_process_group()
    c.expect(not tdist.is_initialized() and not dist.is_initialized(), "after gpucomm's destroy")
    # init_method of a scheme registered with (torch's) register_rendezvous_handler
    dist.register_rendezvous_handler("oneworldtest", _file_pair)
    dist.init_process_group(init_method=f"oneworldtest://{tmp}/store")
    _reduces_over(c, dist.group.WORLD, [0, 1], rank, "a registered rendezvous scheme")
    dist.destroy_process_group()
    res["failures"], res["count"] = c.failures, c.count
    return res


def _four_ranks(rank: int, world_size: int) -> dict:
    c = Checks(rank)
    dist.init_process_group()
    _new_calls(c, rank, world_size)
    dist.destroy_process_group()
    return {"failures": c.failures, "count": c.count}


ENV = {"OMP_NUM_THREADS": "1", "GPUCOMM_TIMEOUT": "120"}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return run_ranks(_two_ranks, 2, str(tmp_path_factory.mktemp("one_world")), env=ENV, timeout=300)


def test_every_check_passes_at_2_ranks(two) -> None:
    failures = [f for r in two for f in r["failures"]]
    assert not failures, "\n".join(failures)
    assert all(r["count"] > 40 for r in two), [r["count"] for r in two]


def test_every_check_passes_at_4_ranks() -> None:
    results = run_ranks(_four_ranks, 4, env=ENV, timeout=300)
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures)
    assert all(r["count"] > 20 for r in results), [r["count"] for r in results]


@pytest.mark.parametrize("run", ["ddp", "ddp_new_group", "ddp_hook", "fsdp2"])
def test_training_keeps_the_replicas_equal(two, run: str) -> None:
    """Every rank ends with the same parameters, and they moved."""
    first, second = two[0][run], two[1][run]
    assert all(torch.equal(first[name], second[name]) for name in first), f"{run}: the ranks disagree"
    torch.manual_seed(0)
    start = torch.nn.Linear(9, 13).weight if run != "fsdp2" else torch.nn.Linear(7, 11).weight
    key = "0.weight"
    assert not torch.equal(first[key], start.detach()), f"{run}: the parameters did not move"


def test_the_three_ddp_runs_agree(two) -> None:
    """The default group, a new_group of the same ranks and the GradBucket hook train alike:
    the first two bitwise (the same reductions), the hook to rounding (it divides first)."""
    plain, sub, hook = two[0]["ddp"], two[0]["ddp_new_group"], two[0]["ddp_hook"]
    assert all(torch.equal(plain[n], sub[n]) for n in plain)
    assert all(torch.allclose(plain[n], hook[n], rtol=1e-5, atol=1e-6) for n in plain)
