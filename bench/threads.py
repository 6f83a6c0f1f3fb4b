"""How many threads each rank's torch runs: as many as the cores the rank may run on.

torch starts one OpenMP thread per core of the machine, whatever the process's affinity. A rank
that ``--bind`` pins to one core then runs two threads on it on a 2-core host, and every
multi-threaded op (the bench's own ``copy_`` of out-of-place all_reduce among them) waits for the
thread that is not running: on the 2-core CI machine the out-of-place column of all_reduce read
about 12 ms at 512 KiB and above against 0.16-1.1 ms in place, for gpucomm and gloo alike, and
the two agreed (278 vs 261 us) with ``OMP_NUM_THREADS=1``.

So a spawned rank runs:

- ``--cpu-threads N``: N threads;
- bound to k cores (``--bind core``, or ``auto`` with a core per rank): k threads;
- unbound: ``OMP_NUM_THREADS`` where the user set it, else its share of the cores
  (cores // ranks, at least 1), as torchrun sets one thread per rank.

Under torchrun the bench starts no process: only ``--cpu-threads`` changes torch's count.
"""

from __future__ import annotations

import os

__all__ = ["plan_threads", "apply_threads", "current_threads"]

# (threads, why) as this process set them; None until apply_threads runs.
_applied: tuple[int, str] | None = None


def plan_threads(cores: set[int] | None, nproc: int, requested: int | None) -> tuple[int | None, str]:
    """The thread count for a spawned rank on ``cores`` (None: unbound), and why; None: leave torch's."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"plan_threads: expected --cpu-threads >= 1, got {requested}")
        return requested, "--cpu-threads"
    if cores is not None:
        return len(cores), f"bound to {len(cores)} core{'s' * (len(cores) != 1)} (--bind)"
    if os.environ.get("OMP_NUM_THREADS"):
        return None, "OMP_NUM_THREADS"
    available = len(os.sched_getaffinity(0))
    return max(1, available // nproc), f"unbound: {available} cores / {nproc} ranks"


def apply_threads(threads: int | None, why: str) -> None:
    """Set torch's intra-op threads (and OMP_NUM_THREADS, for what this rank starts) to ``threads``."""
    global _applied
    import torch

    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    _applied = (torch.get_num_threads(), why)


def current_threads() -> tuple[int, str]:
    """This rank's torch thread count and where it came from."""
    import torch

    if _applied is not None and _applied[0] == torch.get_num_threads():
        return _applied
    why = "OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS") else "torch's default (one per core)"
    return torch.get_num_threads(), why
