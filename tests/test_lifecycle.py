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


def _beside_torch(rank: int, world_size: int, torch_first: bool) -> tuple[float, float]:
    import torch.distributed as tdist

    import gpucomm

    if torch_first:
        tdist.init_process_group("gloo")
        gpucomm.init_process_group()
    else:
        gpucomm.init_process_group()
        tdist.init_process_group("gloo")
    a = torch.tensor([float(rank)])
    b = torch.tensor([float(rank)])
    gpucomm.all_reduce(a)
    tdist.all_reduce(b)
    gpucomm.destroy_process_group()
    tdist.destroy_process_group()
    return a.item(), b.item()


def test_works_beside_torch_distributed_in_either_order() -> None:
    assert run_ranks(_beside_torch, 2, True) == [(1.0, 1.0)] * 2
    assert run_ranks(_beside_torch, 2, False) == [(1.0, 1.0)] * 2
