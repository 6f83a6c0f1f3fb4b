"""Where a bound rank's backends run their own threads: on every core the bench was given.

``--bind`` pins a spawned rank to a core so that two ranks' spinning waiters never share one
(bench/launch.py). Threads start with their creator's cores, so gloo's threads (a TCP loop that
moves every byte through the loopback socket, and the run loops that execute its calls) shared
the rank's one core with it too. Freed (the rank's own thread still bound), they run wherever a
core is idle, as they do under torchrun, which binds nothing.

Measured on the shared 2-core CI machine, 2 ranks, gloo and gpucomm started side by side, 100
calls per cell, CPU wall clock (docs/results/2026-11-29-bench-oop.md): at load average 1.3, with
gloo's threads on the rank's core, 24-86% of gloo's all_reduces of 256 KiB-1 MiB took over 1 ms
(fast ones 0.15-0.45 ms, slow ones about 4 ms), so a 20-call median landed on either side (the
4.76 out-of-place over in-place of docs/results/2026-11-29-bench-quiet.md at 512 KiB); freed,
0-6% did in most cells (39% at most), and gpucomm's calls were unchanged. Under a load average
of 5 both ways stall alike.
"""

from __future__ import annotations

import os

__all__ = ["spread_over", "thread_ids", "release"]

# The cores the backends' threads may use; None: leave them where they start (no --bind, torchrun).
_spread: set[int] | None = None


def spread_over(cores: set[int] | None) -> None:
    """Remember the cores the backends' threads may use; call it before the rank binds itself."""
    global _spread
    if cores is not None and not cores:
        raise ValueError(f"spread_over: expected a non-empty set of cores or None, got {cores!r}")
    _spread = None if cores is None else set(cores)


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
