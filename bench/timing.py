"""Per-call times, how ranks' times make one figure, and the check of a timed call.

Times: CUDA events on a GPU, the wall clock after a synchronize on the CPU; or, with
``graph_launches`` (nccl-tests' ``-G``), the calls captured into a CUDA graph and replayed, which
times the device's work without the host's enqueue in it. Each returns one sample per iteration.

One convention for every bench module, :func:`slowest_rank`: per iteration the slowest rank's
time, then the median over iterations. A collective ends when its last rank ends, so the slowest
rank's time is the collective's (nccl-tests reports the slowest rank too).

One check for every bench module, :func:`check_after`: after the timed calls (after the replays
with ``-G``), inputs reset, one more call, its result compared on every rank. A collective that is
right on its first calls and then does nothing (each rank keeps its own input) passes a check made
before the timed calls and fails this one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["time_calls", "time_graph", "slowest_rank", "check_after", "count_wrong"]


def time_calls(call: Callable[[], None], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Seconds of each of ``iters`` timed calls of ``call``, after ``warmup`` untimed ones."""
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
    return samples


def _time_cuda(call: Callable[[], None], iters: int) -> list[float]:
    # One event pair per call, read after a single synchronize, so that timing adds no host
    # round trip between calls.
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    for start, end in pairs:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in pairs]


def time_graph(call: Callable[[], None], device: torch.device, warmup: int, iters: int, launches: int) -> list[float]:
    """Seconds of one ``call`` on the device, one sample per replay of a CUDA graph (nccl-tests' ``-G``).

    ``iters`` calls are captured into one graph; each of ``launches`` replays runs between two events
    of its own, its time divided by the calls it holds. The ``warmup`` calls (at least one) run first
    on a side stream, as a capture asks: kernels compiled, launches bound, memory allocated before it.

    On a GPU whose host enqueues slower than the device runs (per-call times of small messages),
    this is the device's time per call, which :func:`time_calls` cannot see: its events then hold
    the host's enqueue.
    """
    if device.type != "cuda":
        raise ValueError(f"time_graph: CUDA graphs need a CUDA device, got {device}")
    if iters < 1 or launches < 1 or warmup < 0:
        raise ValueError(
            f"time_graph: expected iters >= 1, launches >= 1 and warmup >= 0, got {iters}, {launches}, {warmup}"
        )
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
    # One event pair per replay, back to back on the stream: no host round trip between replays.
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(launches)]
    stream.synchronize()
    for start, end in pairs:
        start.record(stream)
        graph.replay()
        end.record(stream)
    stream.synchronize()
    return [start.elapsed_time(end) / 1e3 / iters for start, end in pairs]


def slowest_rank(per_rank: Sequence[Sequence[float]]) -> float:
    """The figure of one measurement from ``per_rank[rank][iteration]``.

    Each iteration's slowest rank, then the median over iterations. Every rank must give the same
    number of iterations.
    """
    counts = {len(samples) for samples in per_rank}
    if not per_rank or len(counts) != 1 or 0 in counts:
        raise ValueError(
            f"slowest_rank: expected one or more ranks with the same number (>= 1) of samples, "
            f"got {[len(s) for s in per_rank]}"
        )
    return statistics.median(max(iteration) for iteration in zip(*per_rank))


def count_wrong(got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements of ``got`` that differ from ``want`` (NaN, the outputs' poison, is never equal)."""
    if got.shape != want.shape:
        raise ValueError(f"count_wrong: expected the shape {tuple(want.shape)}, got {tuple(got.shape)}")
    return int((got != want).sum().item())


def check_after(reset: Callable[[], None], call: Callable[[], object], device: torch.device) -> object:
    """Reset, make one ``call()`` after the timed ones and await its end; what the call returned.

    ``reset()`` restores the inputs and poisons the outputs; the caller compares the result.
    """
    reset()
    result = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result
