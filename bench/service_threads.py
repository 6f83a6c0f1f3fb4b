"""Where a bound rank's backends run their own threads: on every core the bench was given.

``--bind`` pins a spawned rank to a core so that two ranks' spinning waiters never share one
(bench/launch.py). Threads start with their creator's cores, so gloo's threads (a TCP loop that
moves every byte through the loopback socket, and the run loops that execute its calls) shared
the rank's one core with it too. Freed (the rank's own thread still bound), they run wherever a
core is idle, as they do under torchrun, which binds nothing.

Measured on the 2-core CI machine, CPU wall clock, load average 4.2-5.5 (other test runs on
it), four pairs of ``gpucomm-bench all_reduce --nproc 2 -b 256K -e 4M --compare gloo --rounds 5``
in alternation (docs/results/2026-11-29-bench-oop.md): with gloo's threads on the rank's core,
gloo's out-of-place over in-place passed 1.5 at some size in every run (at most 3.88, 1.97, 4.76,
2.68); freed, at most 1.46, 1.53, 1.25, 1.33. gpucomm's ratios were alike both ways (1.07-1.55).
Per call, 25-75% of gloo's 256 KiB-1 MiB calls on the rank's core took over 1 ms (p90 about
4 ms, p10 0.25-0.55 ms), so a median of 20 landed on either side. At 1-64 KiB freeing them did
not help (27-38% of calls over 1 ms bound, 0-53% freed, the fast ones slower freed).
"""

from __future__ import annotations

import os

__all__ = ["spread_over", "spread_cores", "thread_ids", "release"]

# The cores the backends' threads may use; None: leave them where they start (no --bind, torchrun).
_spread: set[int] | None = None


def spread_over(cores: set[int] | None) -> None:
    """Remember the cores the backends' threads may use; call it before the rank binds itself."""
    global _spread
    if cores is not None and not cores:
        raise ValueError(f"spread_over: expected a non-empty set of cores or None, got {cores!r}")
    _spread = None if cores is None else set(cores)


def spread_cores() -> list[int] | None:
    """The cores the backends' threads may use, sorted (None: where they start; the header says)."""
    return None if _spread is None else sorted(_spread)


def thread_ids() -> set[int]:
    """This process's thread ids (Linux: /proc/self/task)."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def release(before: set[int]) -> list[str]:
    """Let every thread started since ``before`` run on the remembered cores; their names.

    The calling thread keeps its own cores. Nothing changes where no cores are remembered.
    """
    if _spread is None:
        return []
    names = []
    for tid in sorted(thread_ids() - before):
        try:
            os.sched_setaffinity(tid, _spread)
            with open(f"/proc/self/task/{tid}/comm") as fh:
                names.append(fh.read().strip())
        except (ProcessLookupError, FileNotFoundError):
            continue  # it ended in between
    return names
