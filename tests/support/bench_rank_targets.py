"""Rank bodies for tests/bench/test_bench_ranks.py (spawned processes import them from here)."""

from __future__ import annotations

import os
import time


def give_rank_times_ten(rank: int, nproc: int, port: int, results) -> None:
    results.put((rank, rank * 10))


def last_rank_dies(rank: int, nproc: int, port: int, results) -> None:
    """The last rank ends its process without a result (as a CUDA abort does); the others wait."""
    if rank == nproc - 1:
        os._exit(3)
    time.sleep(120)
    results.put((rank, rank))


def never_answer(rank: int, nproc: int, port: int, results) -> None:
    time.sleep(120)
