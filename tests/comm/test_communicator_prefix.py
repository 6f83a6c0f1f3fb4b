"""Communicators built directly on one store, each with the default prefix, keep apart."""

from __future__ import annotations

import torch
from rank_store import rank_store
from spawn import run_ranks

from gpucomm.comm.communicator import Communicator
from gpucomm.config import Config


def _two_on_one_store(rank: int, world_size: int) -> tuple[bool, list[float], list[float]]:
    store = rank_store(rank, world_size)
    config = Config.from_env(transport="shm", kernels="torch", timeout=20)
    with (
        Communicator(store, rank, world_size, config=config) as first,
        Communicator(store, rank, world_size, config=config) as second,
    ):
        a = torch.full((64,), float(rank + 1))
        b = torch.full((64,), float(10 * (rank + 1)))
        first.all_reduce(a)
        second.all_reduce(b)
        first.all_reduce(a)
        return first.prefix != second.prefix, a[:2].tolist(), b[:2].tolist()


def test_two_communicators_with_the_default_prefix_on_one_store_stay_apart() -> None:
    """The default prefix is drawn from the store (as init_process_group draws its own): with a
    fixed one, the second communicator's workspace open read the first's handles."""
    for apart, a, b in run_ranks(_two_on_one_store, 2, timeout=120):
        assert apart
        assert a == [6.0, 6.0] and b == [30.0, 30.0], (a, b)  # (1 + 2) * 2 and 10 + 20
