"""Spawning the ranks of a benchmark that measures one thing per rank.

Fresh processes, a free port, each rank's result back. The CLI's runner has its own, with rounds
and tables."""

from __future__ import annotations

import multiprocessing
import os
import queue
import socket
import time
from collections.abc import Callable

__all__ = ["RankDied", "rank_env", "spawn_ranks"]

# How often the parent looks for a rank that died without a result. A rank that dies on a GPU
# (an illegal address aborts the process) would otherwise leave the parent waiting out the whole
# ``timeout``, which on a lent machine is the 10-minute call itself.
POLL_S = 0.5


class RankDied(RuntimeError):
    """A rank's process ended without giving its result."""


def rank_env(rank: int, world: int, port: int, **extra: str) -> None:
    """This process's environment as rank ``rank`` of ``world`` local ranks that meet at
    127.0.0.1:``port`` (torch.distributed's env://), and ``extra``: set before a group starts."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


def spawn_ranks(target: Callable[..., None], nproc: int, *args: object, timeout: float = 3600) -> dict[int, object]:
    """Run ``target(rank, nproc, port, *args, results)`` in ``nproc`` spawned processes; ``{rank: value}``.

    Each rank puts ``(rank, value)`` on ``results``. Raises :class:`RankDied` (naming the rank and its
    exit code) as soon as a rank's process has ended without a result, and ``queue.Empty`` if a rank
    gives nothing within ``timeout`` seconds; either way the other ranks are ended first.
    """
    ctx = multiprocessing.get_context("spawn")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, nproc, port, *args, results)) for rank in range(nproc)]
    for proc in procs:
        proc.start()
    try:
        per_rank = _collect(procs, results, timeout)
    except BaseException:
        for proc in procs:
            proc.kill()
        raise
    for proc in procs:
        proc.join()
    return per_rank


def _collect(procs: list, results: object, timeout: float) -> dict[int, object]:
    per_rank: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    while len(per_rank) < len(procs):
        left = deadline - time.monotonic()
        if left <= 0:
            raise queue.Empty(f"spawn_ranks: ranks {_missing(procs, per_rank)} gave no result within {timeout} s")
        try:
            rank, value = results.get(timeout=min(POLL_S, left))
            per_rank[rank] = value
            continue
        except queue.Empty:
            pass
        for rank, proc in enumerate(procs):
            # A rank puts its result before it exits: one more short look at the queue first, so
            # that a result still in the pipe is not taken for a death.
            if rank not in per_rank and proc.exitcode is not None:
                try:
                    got, value = results.get(timeout=POLL_S)
                    per_rank[got] = value
                    break
                except queue.Empty:
                    raise RankDied(
                        f"spawn_ranks: rank {rank} ended with exit code {proc.exitcode} and no result "
                        f"(ranks without one: {_missing(procs, per_rank)})"
                    ) from None
    return per_rank


def _missing(procs: list, per_rank: dict[int, object]) -> list[int]:
    return [rank for rank in range(len(procs)) if rank not in per_rank]
