"""Blocking calls on the caller's current stream, on a GPU: 2 ranks on the cuda_ipc workspace
(they may share one GPU), the Triton and CUDA C++ program kernels.

- A blocking all_reduce inside a side stream's context is queued on that stream: the
  communicator's own stream and the default stream have nothing waiting on it, the side
  stream's later work sees the result, and the result is right once the side stream syncs.
- Asynchronous and blocking calls in turn, from two streams that drift apart: every result
  right, so no two programs of the communicator ran at once (gpucomm.workspace.stream_order).
- A repeated blocking all_reduce takes the host's fast path (no full-path call in 20 after the
  first) and never synchronises the host.

Skipped without CUDA and CuPy.
"""

from __future__ import annotations

import pytest
from cuda_group import NEEDS_CUDA_IPC, init_cuda_group
from spawn import run_ranks

pytestmark = NEEDS_CUDA_IPC

KERNELS = ("triton", "cuda")
WORLD = 2
N = 4096
SLEEP = 200_000_000  # cycles of torch.cuda._sleep: about 0.1 s on a 2 GHz GPU


def _on_a_side_stream(rank: int, world_size: int, kernels: str) -> list[str]:
    import torch

    import gpucomm

    device = init_cuda_group(rank, kernels)
    engine = gpucomm.get_default_communicator()._engines["cuda"]
    t = torch.empty(N, device=device)
    t.fill_(1.0)
    gpucomm.all_reduce(t)  # builds the program, compiles the kernel
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):  # every kernel below launched once before the timed part: a
        torch.cuda._sleep(1)  # first launch may wait while CUDA loads its module (lazy loading),
        _ = t * 2  # and the side stream could be found done at the query
    torch.cuda.synchronize(device)
    failures = []
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP)  # the side stream is busy: whatever waits on it is not done yet
        t.fill_(float(rank + 1))
        gpucomm.all_reduce(t)
        doubled = t * 2  # after the collective, in the side stream's order
        if not engine.stream.query() or not torch.cuda.default_stream(device).query():
            failures.append(
                f"rank {rank}: another stream waits on the side stream: the call was not queued on it alone"
            )
        if side.query():
            failures.append(f"rank {rank}: the side stream was done before its sleep could be")
    side.synchronize()
    want = float(sum(r + 1 for r in range(world_size)))
    if not torch.equal(t, torch.full_like(t, want)) or not torch.equal(doubled, torch.full_like(t, 2 * want)):
        failures.append(
            f"rank {rank}: all_reduce on the side stream gave {t[:2].tolist()}, then {doubled[:2].tolist()}"
        )
    gpucomm.destroy_process_group()
    return failures


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_blocking_call_is_queued_on_the_callers_current_stream(kernels: str) -> None:
    for failures in run_ranks(_on_a_side_stream, WORLD, kernels, timeout=600):
        assert not failures, failures


def _async_and_blocking_in_turn(rank: int, world_size: int, kernels: str, rounds: int) -> list[str]:
    import torch

    import gpucomm

    device = init_cuda_group(rank, kernels)
    streams = [torch.cuda.current_stream(device), torch.cuda.Stream(device)]
    blocking = [torch.empty(N, device=device) for _ in range(rounds)]
    asynchronous = [torch.empty(N, device=device) for _ in range(rounds)]
    for t in blocking + asynchronous:  # warm-up: one binding per buffer
        gpucomm.all_reduce(t)
    torch.cuda.synchronize(device)
    works = []
    for k in range(rounds):
        # Each round: async then blocking, or blocking then async, from one stream or the other,
        # the streams drifting apart differently on each rank.
        stream_a, stream_b = streams[k % 2], streams[(k // 2) % 2]
        with torch.cuda.stream(stream_a):
            torch.cuda._sleep(SLEEP // 10 * ((k + rank) % 3))
            asynchronous[k].fill_(float(rank + k))
            blocking[k].fill_(float(2 * rank + k))
            if k % 2:
                works.append(gpucomm.all_reduce(asynchronous[k], async_op=True))
        with torch.cuda.stream(stream_b):
            stream_b.wait_stream(stream_a)  # the blocking call's input was written on stream_a
            torch.cuda._sleep(SLEEP // 10 * ((k + 1 - rank) % 2))
            gpucomm.all_reduce(blocking[k])
            blocking[k].mul_(3)  # after the collective, in this stream's order
        if not k % 2:
            with torch.cuda.stream(stream_a):
                works.append(gpucomm.all_reduce(asynchronous[k], async_op=True))
    for work in works:
        work.wait()
    torch.cuda.synchronize(device)
    failures = []
    for k in range(rounds):
        want_async = float(sum(r + k for r in range(world_size)))
        want_blocking = 3.0 * sum(2 * r + k for r in range(world_size))
        if not torch.equal(asynchronous[k], torch.full_like(asynchronous[k], want_async)):
            failures.append(
                f"rank {rank}, round {k}: async all_reduce gave {asynchronous[k][:2].tolist()}, expected {want_async}"
            )
        if not torch.equal(blocking[k], torch.full_like(blocking[k], want_blocking)):
            failures.append(
                f"rank {rank}, round {k}: blocking all_reduce gave {blocking[k][:2].tolist()}, expected {want_blocking}"
            )
    gpucomm.destroy_process_group()
    return failures


@pytest.mark.parametrize("kernels", KERNELS)
def test_async_and_blocking_calls_in_turn_from_two_streams(kernels: str) -> None:
    for failures in run_ranks(_async_and_blocking_in_turn, WORLD, kernels, 8, timeout=600):
        assert not failures, failures


def _fast_path(rank: int, world_size: int, kernels: str, calls: int) -> dict:
    import torch

    import gpucomm
    from gpucomm.comm.communicator import Communicator

    device = init_cuda_group(rank, kernels)
    full = []
    original = Communicator._route

    def counted(self, call):  # noqa: ANN001, ANN202
        full.append(call.fn)
        return original(self, call)

    Communicator._route = counted
    t = torch.ones(N, device=device)
    total = torch.zeros(N, device=device)
    gpucomm.all_reduce(t)
    torch.cuda.synchronize(device)
    full.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(calls):
            t.fill_(float(rank + 1))
            gpucomm.all_reduce(t)
            total += t
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ok = torch.equal(total, torch.full_like(total, calls * float(sum(r + 1 for r in range(world_size)))))
    learned = len(gpucomm.get_default_communicator()._repeat._launches)
    gpucomm.destroy_process_group()
    return {"full": full, "ok": ok, "learned": learned}


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_repeated_blocking_all_reduce_takes_the_fast_path(kernels: str) -> None:
    for rank, result in enumerate(run_ranks(_fast_path, WORLD, kernels, 20, timeout=600)):
        assert result["ok"], f"rank {rank}: wrong sums over 20 calls"
        assert result["learned"] == 1 and result["full"] == [], f"rank {rank}: {result}"
