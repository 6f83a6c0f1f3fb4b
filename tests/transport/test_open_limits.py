"""A rank that meets a limit of its host while opening the shm workspace (no descriptor left, no
memory for a mapping) says so through the store: every rank raises the same
WorkspaceUnavailableError at once, naming that rank and the reason, instead of its peers waiting
out the timeout and naming it missing."""

from __future__ import annotations

import datetime
import errno
import os
import time

import pytest
import torch
from rank_store import rank_store, store_barrier
from spawn import run_ranks

from gpucomm.errors import GpucommError
from gpucomm.transport import open_workspace
from gpucomm.transport import shm as shm_module

TIMEOUT_S = 60.0  # what a rank would wait for a peer that said nothing


def _fail_on_rank_1(failure: str, rank: int) -> None:
    """Make this process (rank 1) meet ``failure`` where the open would meet it for real."""
    real_open, real_map = os.open, shm_module._map
    own = f"_r{rank}"

    def open_(path, flags, *args, **kwargs):  # noqa: ANN001, ANN202 - os.open's signature
        name = os.fspath(path)
        if name.startswith("/dev/shm/gpucomm_"):
            if failure == "peer-emfile" and not name.endswith(own):
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), name)
            if failure == "own-emfile" and name.endswith(own):
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), name)
        return real_open(path, flags, *args, **kwargs)

    maps = []

    def map_(fd, size):  # noqa: ANN001, ANN202
        maps.append(fd)
        if failure == "peer-enomem" and len(maps) > 1:  # its own maps first, then the peers'
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        if failure == "own-enomem":
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        return real_map(fd, size)

    os.open = open_
    shm_module._map = map_


def _rank(rank: int, world_size: int, prefix: str, failure: str) -> tuple[str, str, float, list[str]]:
    store = rank_store(rank, world_size)
    if rank == 1:
        _fail_on_rank_1(failure, rank)
    start = time.monotonic()
    try:
        open_workspace(
            "shm",
            store=store,
            prefix=prefix,
            rank=rank,
            world_size=world_size,
            data_bytes=4096,
            flag_count=4,
            device=torch.device("cpu"),
            timeout=TIMEOUT_S,
        ).close()
    except GpucommError as err:
        outcome = type(err).__name__, str(err)
    else:
        outcome = "none", ""
    seconds = time.monotonic() - start
    store_barrier(store, f"{prefix}raised", rank, world_size)
    token = shm_module._prefix_token(prefix)
    left = [n for n in os.listdir(shm_module.SHM_DIR) if n.startswith(f"gpucomm_{token}_")]
    if rank:
        store.set(f"{prefix}done/{rank}", b"1")
    else:
        store.wait([f"{prefix}done/{r}" for r in range(1, world_size)], datetime.timedelta(seconds=60))
    return (*outcome, seconds, left)


@pytest.mark.parametrize(
    "failure, reason",
    [
        ("peer-emfile", "Too many open files"),
        ("peer-enomem", "Cannot allocate memory"),
        ("own-emfile", "Too many open files"),
        ("own-enomem", "Cannot allocate memory"),
    ],
)
def test_a_rank_out_of_descriptors_or_memory_makes_every_rank_raise_at_once(failure, reason):
    prefix = f"limits/{os.urandom(8).hex()}/"
    for rank, (kind, message, seconds, left) in enumerate(run_ranks(_rank, 3, prefix, failure, timeout=180)):
        assert kind == "WorkspaceUnavailableError", (rank, kind, message)
        assert "rank 1" in message and reason in message and "ulimit -n" in message, (rank, message)
        assert seconds < TIMEOUT_S / 3, (
            f"rank {rank} took {seconds:.1f} s: it waited for the timeout instead of agreeing"
        )
        assert left == [], left
