"""The address tables a kernel launch reads, held by every stream that launches with them.

``CudaKernels`` and ``TritonKernels`` keep a device int64 table per tuple of addresses (a
workspace uses the same few call after call) and drop the whole cache when it is full. A table is
made on the stream current at the time, and torch's caching allocator gives a dropped table's
memory back for reuse in the order of that stream alone: a launch on another stream that still
reads it would then read whatever the next allocation writes there. So each launch marks the
table in use by its own stream (``record_stream``), and the memory waits for that stream's work
too. Torch records nothing for the stream the table was made on, and records streams under CUDA
graph capture as well.
"""

from __future__ import annotations

import torch

__all__ = ["held"]


def held(table: torch.Tensor) -> torch.Tensor:
    """``table``, its memory held until the current stream of its device has done what it has
    queued so far (``record_stream``); on the CPU, as it is."""
    if table.device.type == "cuda":
        table.record_stream(torch.cuda.current_stream(table.device))
    return table
