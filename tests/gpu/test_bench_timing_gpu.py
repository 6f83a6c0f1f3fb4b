"""The benchmarks' CUDA-graph timing (``gpucomm-bench -G``, bench/timing.py ``time_graph``) on a GPU:
it runs the calls it says it times, gives one sample per replay, and times the device's work.

Skipped without CUDA.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from gpucomm._bench.timing import time_calls, time_graph

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_time_graph_runs_the_warmup_the_first_replay_and_every_timed_call() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    t = torch.zeros(4, dtype=torch.int64, device=device)
    warmup, iters, launches = 3, 7, 5
    samples = time_graph(lambda: t.add_(1), device, warmup, iters, launches)
    torch.cuda.synchronize(device)
    # The capture itself runs nothing; the first replay (untimed) does.
    assert t.tolist() == [warmup + iters + launches * iters] * 4
    assert len(samples) == launches
    assert all(0 < seconds < 1e-3 for seconds in samples), samples


def test_time_graph_and_per_call_events_agree_on_a_device_bound_call() -> None:
    """A call far longer than its enqueue: both ways time the device, within the noise."""
    device = torch.device("cuda", torch.cuda.current_device())
    sleep = lambda: torch.cuda._sleep(2_000_000)  # noqa: E731 - about 1 ms at H100 clocks
    per_call = statistics.median(time_calls(sleep, device, 2, 10))
    graphed = statistics.median(time_graph(sleep, device, 2, 10, 3))
    assert 0.8 < graphed / per_call < 1.25, (graphed, per_call)
