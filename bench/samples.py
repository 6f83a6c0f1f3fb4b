"""Per-call samples on the host's clock, and their summary.

No torch here: a rank may import this before it sets what must be set before torch or triton is
imported."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

__all__ = ["each_call", "median_p90_us"]


def each_call(call: Callable[[], object], calls: int) -> list[float]:
    """Seconds of each of ``calls`` calls of ``call``, timed alone by the host's clock."""
    clock, times = time.perf_counter, []
    for _ in range(calls):
        start = clock()
        call()
        times.append(clock() - start)
    return times


def median_p90_us(seconds: list[float]) -> dict[str, float]:
    """The median and the 90th percentile of ``seconds``, in microseconds."""
    ordered = sorted(seconds)
    return {"median_us": statistics.median(ordered) * 1e6, "p90_us": ordered[int(0.9 * (len(ordered) - 1))] * 1e6}
