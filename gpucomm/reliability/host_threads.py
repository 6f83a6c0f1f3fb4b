"""How the host executor's copies and folds stay off torch's thread pool when it is too wide.

torch runs an elementwise op of ``GRAIN`` elements or more on its OpenMP pool, which is
``torch.get_num_threads()`` wide: every core of the machine unless OMP_NUM_THREADS says
otherwise (torchrun sets it to 1; ``torch.multiprocessing.spawn``, ``multiprocessing``, srun,
mpirun and notebooks do not). After each parallel region libgomp's workers spin for a while
(OMP_WAIT_POLICY unset) on the very cores that the other ranks of this host need to reach the
next sync, so every sync waits for a peer that cannot run. Measured on the 2-core CI VM, 2 ranks
unbound, all_reduce against gloo (gpucomm-bench --rounds 3, other work on the machine):

    torch's default threads (2 per rank):         1 MiB 0.61-6.6x, 16 MiB 3.3-4.8x gloo's time
    the same with OMP_WAIT_POLICY=passive:        1 MiB 1.0-1.3x,  16 MiB 0.32-0.38x
    the same with these pieces (no knob at all):  see docs/benchmarks.md

OMP_WAIT_POLICY only works when set before torch loads, and setting ``torch.set_num_threads``
would change the caller's own compute threads (it is process-wide in torch). So where the pool
is wider than this rank's share of the cores (cores // ranks on this host), each copy and fold
runs in pieces below the grain, in the calling thread alone: no parallel region, no spinning
workers, the caller's settings untouched. Where the pool fits the share (one thread per rank, or
a machine with cores to spare), ops run whole on the pool as the caller configured it. Pieces
cost 3-5% of a 3 MiB copy's time (248 against 237 us, one thread, 2-core VM).
"""

from __future__ import annotations

import os

import torch

__all__ = ["GRAIN", "PIECE", "ThreadFit", "pieces"]

# at::internal::GRAIN_SIZE: TensorIterator runs an op of fewer elements serially, in the calling
# thread, whatever torch.get_num_threads() says.
GRAIN = 32768
# The largest piece below the grain that keeps every piece 64-byte aligned for any element size.
PIECE = GRAIN - 16


class ThreadFit:
    """Whether a collective's copies and folds must avoid torch's pool (module docstring).

    Args:
        ranks_here: ranks of the workspace on this host.
        cores: cores this process may run on (default: its affinity mask).
    """

    def __init__(self, ranks_here: int, cores: int | None = None) -> None:
        cores = len(os.sched_getaffinity(0)) if cores is None else cores
        self.share = max(1, cores // max(1, ranks_here))

    def serial(self) -> bool:
        """True while torch's pool (in the calling thread) is wider than this rank's cores.

        Asked at every call, since the caller may change its threads between calls.
        """
        return torch.get_num_threads() > self.share


def pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor`` (1-D) as views of at most :data:`PIECE` elements; [tensor] when it is small."""
    if tensor.numel() < GRAIN:
        return [tensor]
    return list(tensor.split(PIECE))
