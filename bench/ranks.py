"""Spawning the ranks of a benchmark that measures one thing per rank.

Fresh processes, a free port, each rank's result back. The CLI's runner has its own, with rounds
and tables."""

from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable

__all__ = ["spawn_ranks"]


def spawn_ranks(target: Callable[..., None], nproc: int, *args: object, timeout: float = 3600) -> dict[int, object]:
    """Run ``target(rank, nproc, port, *args, results)`` in ``nproc`` spawned processes; ``{rank: value}``.

    Each rank puts ``(rank, value)`` on ``results``. Raises ``queue.Empty`` if a rank gives nothing
    within ``timeout`` seconds.
    """
    ctx = multiprocessing.get_context("spawn")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, nproc, port, *args, results)) for rank in range(nproc)]
    for proc in procs:
        proc.start()
    per_rank = dict(results.get(timeout=timeout) for _ in procs)
    for proc in procs:
        proc.join()
    return per_rank
