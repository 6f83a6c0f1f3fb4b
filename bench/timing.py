"""Per-call times: CUDA events on a GPU, the wall clock after a synchronize on the CPU; or, with
``graph_launches`` (nccl-tests' ``-G``), the calls captured into a CUDA graph and replayed, which
times the device's work without the host's enqueue in it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["time_calls", "time_graph"]


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


def time_graph(call: Callable[[], None], device: torch.device, warmup: int, iters: int, launches: int) -> float:
    """Seconds of one ``call`` on the device: ``iters`` calls captured into one CUDA graph, the
    graph replayed ``launches`` times between two events, the time divided by every call (as
    nccl-tests' ``-G``). The ``warmup`` calls (at least one) run first on a side stream, as a
    capture asks: kernels compiled, launches bound, memory allocated before it.

    On a GPU whose host enqueues slower than the device runs (per-call times of small messages),
    this is the device's time per call, which :func:`time_calls` cannot see: its events then hold
    the host's enqueue."""
    if device.type != "cuda":
        raise ValueError(f"time_graph: CUDA graphs need a CUDA device, got {device}")
    if iters < 1 or launches < 1 or warmup < 0:
        raise ValueError(f"time_graph: expected iters >= 1, launches >= 1 and warmup >= 0, got {iters}, {launches}, {warmup}")
    stream = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            call()
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            call()
    graph.replay()  # the first replay uploads the graph: untimed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream.synchronize()
    start.record(stream)
    for _ in range(launches):
        graph.replay()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (launches * iters)
