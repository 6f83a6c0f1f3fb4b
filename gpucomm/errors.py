"""The exceptions gpucomm raises.

Bad arguments raise the builtin ``ValueError`` / ``TypeError``; everything that goes wrong with
the environment, a peer or a timeout raises a subclass of :class:`GpucommError`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "GpucommError",
    "NotInitializedError",
    "UnsupportedError",
    "CommTimeoutError",
    "CommMismatchError",
    "CommBrokenError",
    "KernelCompileError",
]


class GpucommError(RuntimeError):
    """Base class of gpucomm's own runtime errors."""


class NotInitializedError(GpucommError):
    """A collective was called before ``init_process_group`` (or after destroy)."""


class UnsupportedError(GpucommError):
    """A knob asked for something this host cannot do (e.g. ``GPUCOMM_KERNELS=cuda`` without CUDA)."""


class CommTimeoutError(GpucommError):
    """A peer did not arrive before the deadline.

    Attributes name what the error message says: the collective, the epoch (the communicator's
    step counter, equal on all ranks for the same step), the waiting rank and the ranks that were
    still missing when the deadline passed.
    """

    def __init__(
        self,
        op: str,
        epoch: int | None,
        rank: int,
        missing: Sequence[int],
        timeout: float,
        detail: str = "",
    ) -> None:
        self.op = op
        self.epoch = epoch
        self.rank = rank
        self.missing = list(missing)
        self.timeout = timeout
        where = f" epoch {epoch}" if epoch is not None else ""
        extra = f": {detail}" if detail else ""
        super().__init__(
            f"gpucomm {op}{where}: rank {rank} timed out after {timeout:g} s waiting for "
            f"rank(s) {self.missing}{extra}"
        )


class CommMismatchError(GpucommError):
    """Ranks called different collectives (or sizes, dtypes, ops, roots) in the same epoch."""


class CommBrokenError(GpucommError):
    """The communicator failed earlier; every later call raises this with the original cause."""


class KernelCompileError(GpucommError):
    """A kernel failed to compile; the message carries the compiler's log."""
