"""init / destroy / init, rendezvous flavours, subgroups, and gpucomm beside torch.distributed."""

from __future__ import annotations

import os

import torch
from spawn import run_ranks


def _init_destroy_init(rank: int, world_size: int) -> list[float]:
    import gpucomm

    sums = []
    for round_ in range(3):
        gpucomm.init_process_group(timeout=30)
        assert gpucomm.is_initialized() and gpucomm.get_rank() == rank and gpucomm.get_world_size() == world_size
        t = torch.tensor([float(rank + round_)])
        gpucomm.all_reduce(t)
        sums.append(t.item())
        gpucomm.destroy_process_group()
        assert not gpucomm.is_initialized()
    return sums


def test_init_after_destroy_works() -> None:
    assert run_ranks(_init_destroy_init, 3) == [[3.0, 6.0, 9.0]] * 3


def _file_and_tcp(rank: int, world_size: int, path: str) -> list[float]:
    import gpucomm

    out = []
    for method in (f"file://{path}", f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}"):
        gpucomm.init_process_group(init_method=method, rank=rank, world_size=world_size)
        t = torch.tensor([1.0])
        gpucomm.all_reduce(t)
        out.append(t.item())
        gpucomm.destroy_process_group()
    store = torch.distributed.HashStore() if world_size == 1 else torch.distributed.FileStore(path + ".own", world_size)
    gpucomm.init_process_group(store=store, rank=rank, world_size=world_size)
    t = torch.tensor([2.0])
    gpucomm.all_reduce(t)
    out.append(t.item())
    gpucomm.destroy_process_group()
    return out


def test_file_tcp_and_store_rendezvous(tmp_path) -> None:
    assert run_ranks(_file_and_tcp, 2, str(tmp_path / "store")) == [[2.0, 2.0, 4.0]] * 2


def _subgroups(rank: int, world_size: int) -> tuple[float, float, int, object]:
    import gpucomm

    gpucomm.init_process_group()
    evens = gpucomm.new_group([0, 2])
    odds = gpucomm.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    gpucomm.all_reduce(t, group=mine)
    b = torch.tensor([float(rank)])
    gpucomm.broadcast(b, src=2 if rank % 2 == 0 else 3, group=mine)  # src is a global rank
    outsider = gpucomm.get_rank(odds if rank % 2 == 0 else evens)
    whole = torch.tensor([1.0])
    gpucomm.all_reduce(whole)
    gpucomm.destroy_process_group()
    return t.item(), b.item(), outsider, whole.item()


def test_subgroups_reduce_within_themselves() -> None:
    got = run_ranks(_subgroups, 4)
    assert got == [(2.0, 2.0, -1, 4.0), (4.0, 3.0, -1, 4.0), (2.0, 2.0, -1, 4.0), (4.0, 3.0, -1, 4.0)]


def _beside_torch(rank: int, world_size: int, torch_first: bool) -> tuple[float, float, str, object]:
    """torch.distributed's gloo and gpucomm in one process, in either order.

    torch first: gpucomm's default group stands beside torch's gloo one (gpucomm.distributed.beside_torch's
    ``BesideTorch``). gpucomm first: torch's default group *is* gpucomm's (one world), so torch
    refuses a second default group, as it refuses any; a gloo group comes from new_group."""
    import torch.distributed as tdist

    import gpucomm

    if torch_first:
        tdist.init_process_group("gloo")
        gpucomm.init_process_group()
        gloo = None
        refused = "-"
        group_world = torch.tensor([1.0])
        gpucomm.all_reduce(group_world, group=gpucomm.group.WORLD)  # torch's default group: gpucomm's beside it
    else:
        gpucomm.init_process_group()
        try:
            tdist.init_process_group("gloo")
            refused = "no"
        except ValueError as err:
            refused = str(err)
        gloo = tdist.new_group(backend="gloo")
        group_world = torch.tensor([float(tdist.get_backend() == "gpucomm")])
    a = torch.tensor([float(rank)])
    b = torch.tensor([float(rank)])
    gpucomm.all_reduce(a)
    tdist.all_reduce(b, group=gloo)
    backend = tdist.get_backend(gloo)
    gpucomm.destroy_process_group()
    if torch_first:
        tdist.destroy_process_group()
    return a.item(), b.item(), backend, (refused, group_world.item(), tdist.is_initialized())


def test_works_beside_torch_distributed_in_either_order() -> None:
    assert run_ranks(_beside_torch, 2, True) == [(1.0, 1.0, "gloo", ("-", 2.0, False))] * 2
    for a, b, backend, (refused, one_world, left) in run_ranks(_beside_torch, 2, False):
        assert (a, b, backend, one_world, left) == (1.0, 1.0, "gloo", 1.0, False)
        assert "trying to initialize the default process group twice" in refused, refused


def _groups_beside_torch(rank: int, world_size: int) -> dict:
    """Every way of making a group, on a gpucomm default group beside torch's gloo one."""
    import torch.distributed as tdist

    import gpucomm

    tdist.init_process_group("gloo")
    gpucomm.init_process_group()
    out: dict = {"world": gpucomm.get_process_group_ranks(gpucomm.group.WORLD)}
    halves = [gpucomm.new_group([0, 2]), gpucomm.new_group([1, 3])]
    half = halves[rank % 2]
    out["kinds"] = [type(g).__name__ if isinstance(g, gpucomm.Communicator) else g for g in halves]
    t = torch.tensor([float(rank)])
    gpucomm.all_reduce(t, group=half)
    out["half sum"] = t.item()
    mine, pairs = gpucomm.new_subgroups(2)
    out["subgroups"] = (gpucomm.get_process_group_ranks(mine), len(pairs))
    mine, crossed = gpucomm.new_subgroups_by_enumeration([[0, 3], [1, 2]])
    out["enumeration"] = (gpucomm.get_process_group_ranks(mine), len(crossed))
    out["split"] = gpucomm.get_process_group_ranks(gpucomm.split_group(None, [[0, 1], [3, 2]]))
    out["split of a half"] = gpucomm.get_process_group_ranks(gpucomm.split_group(half, [[1], [0]]))
    refused = {}
    for label, call in (
        ("local", lambda: gpucomm.new_group([rank], use_local_synchronization=True)),
        ("shrink", lambda: gpucomm.shrink_group([1 - half.rank], group=half)),
    ):
        try:
            call()
        except gpucomm.UnsupportedError as err:
            refused[label] = str(err)
    out["refused"] = refused
    gpucomm.destroy_process_group(half)
    out["half closed"] = half.closed and not mine.closed
    gpucomm.destroy_process_group()
    out["all closed"] = mine.closed and all(g.closed for g in pairs if isinstance(g, gpucomm.Communicator))
    out["torch's stays"] = tdist.is_initialized() and not gpucomm.is_initialized()
    tdist.destroy_process_group()
    return out


def test_groups_beside_torch_distributed() -> None:
    for rank, got in enumerate(run_ranks(_groups_beside_torch, 4)):
        assert got["world"] == [0, 1, 2, 3]
        assert got["kinds"] == (["Communicator", -100] if rank % 2 == 0 else [-100, "Communicator"])
        assert got["half sum"] == (2.0 if rank % 2 == 0 else 4.0)
        assert got["subgroups"] == ([0, 1] if rank < 2 else [2, 3], 2)
        assert got["enumeration"] == ([0, 3] if rank in (0, 3) else [1, 2], 2)
        assert got["split"] == ([0, 1] if rank < 2 else [2, 3])
        assert got["split of a half"] == [rank]
        assert "use_local_synchronization=True needs gpucomm's default group to be torch's" in got["refused"]["local"]
        assert "shrinking needs gpucomm's default group to be torch's" in got["refused"]["shrink"]
        assert got["half closed"] and got["all closed"] and got["torch's stays"]
