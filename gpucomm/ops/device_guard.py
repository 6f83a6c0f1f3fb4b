"""Every launch on its own GPU: the one device guard gpucomm's launchers take.

A process may drive several GPUs, and the thread that calls gpucomm may have another device
current than the communicator's (a rank that never called ``torch.cuda.set_device``, a training
loop that switched devices). Triton's JIT launches where torch's current device is: it loads the
module into that device's context and takes that device's current stream. A launch for a
communicator on device d made from a thread on device e would then run on e's stream, in e's
context, reading d's memory from there.

So gpucomm's launchers run each launch under :func:`on_device` (torch's current device becomes
the kernels' for the launch; the caller's comes back after, as ``torch.cuda.device`` restores it):
:class:`gpucomm.ops.triton_ops.TritonKernels` (copy, reduce, signal, wait, and the program
kernel where Triton's own launcher serves it), the device executor's launches, the multimem
kernel and the device API's kernels (:class:`gpucomm.language.DeviceContext`). Raw driver
launches through gpucomm's launcher need no guard: a bound launch carries the context its
function was loaded into (``kernels/host/launch.c``), so the repeated call's one
``cuLaunchKernel`` lands on its GPU whatever the thread holds, at the price of one
``cuCtxGetCurrent``. Allocations, streams and events name their device explicitly
(``torch.tensor(..., device=d)``, ``torch.cuda.Stream(d)``; an event takes its stream's).

tests/workspace/test_multi_device.py drives a communicator's launchers for device 1 while device 0 is
current, on the tests' driver double.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

__all__ = ["on_device", "launching_on"]


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """``device`` current for what runs inside (the caller's current device back after); nothing
    off a GPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def launching_on(device: torch.device, launch: Callable[[], None]) -> Callable[[], None]:
    """``launch`` (a packed launch, called bare) made with ``device`` current; ``launch`` itself
    off a GPU."""
    if device.type != "cuda":
        return launch

    def guarded() -> None:
        with torch.cuda.device(device):
            launch()

    return guarded
