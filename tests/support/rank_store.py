"""Store helpers for tests that drive a transport directly (without init_process_group)."""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist


def rank_store(rank: int, world_size: int) -> dist.Store:
    """A TCPStore from the harness's MASTER_ADDR/PORT, under a test-only PrefixStore."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        rank == 0,
        timeout=datetime.timedelta(seconds=60),
        wait_for_workers=False,
    )
    return dist.PrefixStore("gpucomm_test/", store)


def store_barrier(store: dist.Store, name: str, rank: int, world_size: int) -> None:
    """Return once every rank has reached barrier ``name`` (waits 60 s at most)."""
    store.set(f"{name}/{rank}", b"1")
    store.wait([f"{name}/{r}" for r in range(world_size)], datetime.timedelta(seconds=60))
