"""CUDA graph capture, seen from gpucomm: whether the caller is capturing, and safe event queries.

- A collective captured into a graph must find everything it launches with on the device already
  (tables built by an eager call of the same shape on the same tensors), and what it uses must
  outlive the graph (the engine never evicts a program a capture used).
- The watchdog thread queries CUDA events. While another thread captures in CUDA's default
  (global) capture mode, a query from any thread in global mode invalidates that capture; a thread
  in thread-local mode may query freely. So the watchdog puts itself in thread-local mode once,
  before its first query, as torch's NCCL watchdog does. The mode is the driver's, per thread,
  shared by every CUDA runtime loaded in the process (torch's and CuPy's).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

__all__ = ["capturing", "capturing_on", "enter_thread_local_capture_mode"]

# CUstreamCaptureMode (cuda.h): the values cuThreadExchangeStreamCaptureMode takes.
CAPTURE_MODE_GLOBAL, CAPTURE_MODE_THREAD_LOCAL, CAPTURE_MODE_RELAXED = 0, 1, 2


def capturing(device: torch.device) -> bool:
    """Whether this thread's current stream on ``device`` is capturing a CUDA graph."""
    if device.type != "cuda":
        return False
    return capturing_on(device.index if device.index is not None else torch.cuda.current_device())()


def capturing_on(index: int) -> Callable[[], bool]:
    """Whether this thread's current stream on GPU ``index`` captures a CUDA graph.

    torch answers for the current device's stream, and the caller's current device may be another
    GPU than the communicator's: two C calls where it is ``index``, a device switch where not.
    """
    C = torch._C

    def asked() -> bool:
        if C._cuda_getDevice() == index:
            return C._cuda_isCurrentStreamCapturing()
        with torch.cuda.device(index):
            return C._cuda_isCurrentStreamCapturing()

    return asked


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _exchange_mode(mode: int) -> int | None:
    """Set this thread's capture mode; the previous one, or None where there is no driver."""
    driver = _driver()
    if driver is None:
        return None
    value = ctypes.c_int(mode)
    if driver.cuThreadExchangeStreamCaptureMode(ctypes.byref(value)) != 0:
        return None
    return value.value


def enter_thread_local_capture_mode() -> bool:
    """Put the calling thread in thread-local capture mode for good; False where the driver cannot.

    Without a CUDA driver there is no capture to break either.
    """
    return _exchange_mode(CAPTURE_MODE_THREAD_LOCAL) is not None
