"""Per-call times: CUDA events on a GPU, the wall clock after a synchronize on the CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["time_calls"]


def time_calls(call: Callable[[], None], device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds of one ``call`` over ``iters`` timed calls, after ``warmup`` untimed ones."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"time_calls: expected iters >= 1 and warmup >= 0, got iters={iters} warmup={warmup}")
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        return _time_cuda(call, iters)
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _time_cuda(call: Callable[[], None], iters: int) -> float:
    # One event pair per call, read after a single synchronize, so that timing adds no host
    # round trip between calls.
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    for start, end in pairs:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs) / 1e3
