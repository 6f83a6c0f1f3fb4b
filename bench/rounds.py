"""Repeated rounds: the order the backends run in, and one figure per cell with its spread.

Each round measures every backend once at a size, in an order that alternates (A, B, then B, A),
so that a machine whose speed drifts during the run (a busy neighbour, clock steps) weighs on
every backend alike. The reported time is the median over rounds; min and max are the spread.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import TypeVar

from .timing import slowest_rank

__all__ = ["round_order", "combine_rounds"]

T = TypeVar("T")


def round_order(items: Sequence[T], k: int) -> list[T]:
    """Round ``k``'s order: as given on even rounds, reversed on odd ones."""
    return list(items) if k % 2 == 0 else list(reversed(items))


def combine_rounds(size: int, factor: float, cells: Sequence[Sequence[dict | None]]) -> dict | None:
    """One variant's table cell from ``cells[rank][round] = {"samples", "wrong"}``.

    None where a cell is None (no such variant). ``samples`` are the seconds of each timed iteration. A round's time is
    :func:`timing.slowest_rank` of its samples (per iteration the slowest rank, then the median over
    iterations); the cell's time is the median of the rounds' times. ``wrong`` sums over ranks and
    rounds (every round is checked after its timed calls), None where the check was off.
    """
    if any(c is None for per_rank in cells for c in per_rank):
        return None
    rounds = len(cells[0])
    round_s = [slowest_rank([per_rank[k]["samples"] for per_rank in cells]) for k in range(rounds)]
    seconds = statistics.median(round_s)
    algbw = size / seconds / 1e9
    wrongs = [c["wrong"] for per_rank in cells for c in per_rank]
    return {
        "time_us": seconds * 1e6,
        "algbw": algbw,
        "busbw": algbw * factor,
        "wrong": None if None in wrongs else sum(wrongs),
        # Each rank's own median over every timed iteration: which rank was the slow one.
        "rank_time_us": [statistics.median(t for c in per_rank for t in c["samples"]) * 1e6 for per_rank in cells],
        "round_time_us": [s * 1e6 for s in round_s],
        "time_min_us": min(round_s) * 1e6,
        "time_max_us": max(round_s) * 1e6,
    }
