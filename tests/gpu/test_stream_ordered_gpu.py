"""The stream-ordered workspace path on a GPU, with the Triton and the CUDA C++ program kernels:
2 ranks on the cuda_ipc transport (they may share one GPU).

- No host synchronisation: a burst of 50 collectives (one-shot and two-shot all_reduce,
  all_gather_into_tensor, reduce_scatter_tensor, broadcast) after a warm-up call of each shape,
  under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising call.
- CUDA graphs: all_reduce, all_gather_into_tensor and reduce_scatter_tensor captured once and
  replayed 100 times with fresh inputs copied into the captured tensors, every result checked
  exactly (integer-valued floats), then an eager call that goes on from the replayed epochs.
- One kernel launch per small all_reduce (the small-message kernel), counted by the torch
  profiler's CUDA activity.
- A peer killed during a stream of collectives: CommTimeoutError naming it within timeout + 5 s.
  The calls return without waiting for the GPU; the error surfaces at the next call.

Skipped without CUDA and CuPy.
"""

from __future__ import annotations

import pytest
from cuda_group import NEEDS_CUDA_IPC, init_cuda_group
from spawn import run_ranks

pytestmark = NEEDS_CUDA_IPC

KERNELS = ("triton", "cuda")
WORLD = 2
N = 1000  # elements: 4 KB of fp32, a one-shot all_reduce in one piece


def _data(seed: int, rank: int, count: int):
    """Integer-valued floats: every sum below is exact, so results compare with torch.equal."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randint(-50, 50, (count,), generator=gen).to(torch.float32)


def _burst_without_host_sync(rank: int, world_size: int, kernels: str, rounds: int) -> list[str]:
    import dataclasses

    import torch

    import gpucomm
    from gpucomm.comm.communicator import Communicator

    device = init_cuda_group(rank, kernels)
    world = gpucomm.get_default_communicator()
    comms = {
        algo: Communicator(
            world.store,
            rank,
            world_size,
            prefix=f"{world.prefix}{algo}/",
            config=dataclasses.replace(world.config, algo=algo),
        )
        for algo in ("oneshot", "twoshot")
    }
    P, root = world_size, world_size - 1
    sizes = {"oneshot": N, "twoshot": N, "all_gather": N, "reduce_scatter": N * P, "broadcast": N}
    inputs = {name: [_data(seed, r, n) for r in range(P)] for seed, (name, n) in enumerate(sizes.items())}
    mine = {name: values[rank].to(device) for name, values in inputs.items()}
    work = {name: torch.empty_like(mine[name]) for name in ("oneshot", "twoshot", "broadcast")}
    gathered, scattered = torch.empty(N * P, device=device), torch.empty(N, device=device)
    totals = {name: torch.zeros(N * P if name == "all_gather" else N, device=device) for name in sizes}

    def one_round() -> None:
        # Device-to-device copies and additions only: none of them waits for the GPU.
        for algo in ("oneshot", "twoshot"):
            work[algo].copy_(mine[algo])
            comms[algo].all_reduce(work[algo])
            totals[algo] += work[algo]
        comms["oneshot"].all_gather_into_tensor(gathered, mine["all_gather"])
        totals["all_gather"] += gathered
        comms["oneshot"].reduce_scatter_tensor(scattered, mine["reduce_scatter"])
        totals["reduce_scatter"] += scattered
        work["broadcast"].copy_(mine["broadcast"])
        comms["oneshot"].broadcast(work["broadcast"], root)
        totals["broadcast"] += work["broadcast"]

    one_round()  # builds every program, compiles every kernel, uploads every table
    torch.cuda.synchronize(device)
    for total in totals.values():
        total.zero_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(rounds):
            one_round()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = {name: t.cpu() for name, t in totals.items()}
    reduced = {name: sum(v.double() for v in values).float() for name, values in inputs.items()}
    want = {
        "oneshot": reduced["oneshot"],
        "twoshot": reduced["twoshot"],
        "all_gather": torch.cat(inputs["all_gather"]),
        "reduce_scatter": reduced["reduce_scatter"][rank * N : (rank + 1) * N],
        "broadcast": inputs["broadcast"][root],
    }
    failures = [name for name in want if not torch.equal(got[name], want[name] * rounds)]
    for comm in comms.values():
        comm.close()
    gpucomm.destroy_process_group()
    return failures


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_burst_of_collectives_never_synchronises_the_host(kernels: str) -> None:
    rounds = 10  # 5 collectives each
    for rank, failures in enumerate(run_ranks(_burst_without_host_sync, WORLD, kernels, rounds, timeout=600)):
        assert not failures, f"rank {rank}: wrong sums of {failures} over {rounds} rounds"


def _graph_replays(rank: int, world_size: int, kernels: str, replays: int) -> list[str]:
    import torch

    import gpucomm

    device = init_cuda_group(rank, kernels)
    P = world_size
    t = torch.empty(N, device=device)
    mine, gathered = torch.empty(N, device=device), torch.empty(N * P, device=device)
    big, out = torch.empty(N * P, device=device), torch.empty(N, device=device)

    def fill(seed: int) -> None:
        t.copy_(_data(3 * seed, rank, N).to(device))
        mine.copy_(_data(3 * seed + 1, rank, N).to(device))
        big.copy_(_data(3 * seed + 2, rank, N * P).to(device))
        for poisoned in (gathered, out):
            poisoned.fill_(float("nan"))

    def check(seed: int) -> list[str]:
        want = {
            "all_reduce": (t, sum(_data(3 * seed, r, N) for r in range(P))),
            "all_gather_into_tensor": (gathered, torch.cat([_data(3 * seed + 1, r, N) for r in range(P)])),
            "reduce_scatter_tensor": (
                out,
                sum(_data(3 * seed + 2, r, N * P) for r in range(P))[rank * N : (rank + 1) * N],
            ),
        }
        return [
            f"{name} (seed {seed})" for name, (got, expected) in want.items() if not torch.equal(got.cpu(), expected)
        ]

    def collectives() -> None:
        gpucomm.all_reduce(t)
        gpucomm.all_gather_into_tensor(gathered, mine)
        gpucomm.reduce_scatter_tensor(out, big)

    # Warm-up on a side stream, as torch.cuda.graph asks: the programs of these tensors are built
    # and their kernels compiled before the capture.
    fill(0)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        collectives()
    torch.cuda.current_stream(device).wait_stream(side)
    failures = check(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        collectives()
    for k in range(1, replays + 1):
        fill(k)
        graph.replay()
        failures += check(k)
    fill(replays + 1)
    collectives()  # eager again, from the epochs the replays left on the device
    failures += check(replays + 1)
    del graph
    gpucomm.destroy_process_group()
    return failures


@pytest.mark.parametrize("kernels", KERNELS)
def test_captured_collectives_replay_with_fresh_inputs(kernels: str) -> None:
    for rank, failures in enumerate(run_ranks(_graph_replays, WORLD, kernels, 100, timeout=600)):
        assert not failures, f"rank {rank}: wrong results of {failures[:10]} ({len(failures)} in all)"


def _kernels_of_one_all_reduce(rank: int, world_size: int, kernels: str) -> list[str]:
    import torch

    import gpucomm

    device = init_cuda_group(rank, kernels)
    t = torch.ones(N, device=device)
    gpucomm.all_reduce(t)  # builds the program, compiles the kernel
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gpucomm.all_reduce(t)
        torch.cuda.synchronize(device)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ok = torch.equal(t.cpu(), torch.full((N,), float(world_size**2)))
    gpucomm.destroy_process_group()
    return names if ok else ["wrong result"]


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_small_all_reduce_is_one_kernel_launch(kernels: str) -> None:
    for rank, names in enumerate(run_ranks(_kernels_of_one_all_reduce, WORLD, kernels, timeout=600)):
        # Nothing else runs on the GPU: no copy in or out, no flag kernel, no memset. `auto` runs
        # a 4 KB all_reduce as oneshot_small (kernels/triton/small.py, kernels/cuda/small.cu).
        assert len(names) == 1 and "small" in names[0], f"rank {rank}: GPU activity {names}"


def _killed_peer(rank: int, world_size: int, kernels: str, victim: int, timeout: float) -> tuple[float, list[int], str]:
    import os
    import signal
    import threading
    import time

    import torch

    import gpucomm

    device = init_cuda_group(rank, kernels)
    t = torch.zeros(1 << 16, device=device)
    # The first call compiles the kernel, which may take the ranks different times: under the
    # default group's long timeout. The group under test shares the compiled kernels.
    gpucomm.all_reduce(t)
    group = gpucomm.new_group(timeout=timeout)
    gpucomm.all_reduce(t, group=group)
    torch.cuda.synchronize(device)
    if rank == victim:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        # The host only enqueues; it goes on until a launch finds the error a kernel recorded.
        while time.monotonic() - start < timeout + 30:
            gpucomm.all_reduce(t, group=group)
    except gpucomm.CommTimeoutError as err:
        elapsed = time.monotonic() - start
        with pytest.raises(gpucomm.CommBrokenError):
            gpucomm.all_reduce(t, group=group)
        # No destroy_process_group: closing a cuda_ipc workspace is collective, and the peer is
        # gone; the process's exit frees it.
        return elapsed, err.missing, str(err)
    raise AssertionError(f"rank {rank}: the collectives went on for {timeout + 30} s with a dead peer")


@pytest.mark.parametrize("kernels", KERNELS)
def test_killed_peer_is_named_within_timeout_plus_5s(kernels: str) -> None:
    timeout, victim = 4.0, 1
    results = run_ranks(_killed_peer, WORLD, kernels, victim, timeout, allow_exit=(victim,), timeout=300)
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        elapsed, missing, message = result
        assert missing == [victim] and f"rank {rank} timed out" in message, message
        assert elapsed <= timeout + 5, f"rank {rank}: {elapsed:.1f} s"
