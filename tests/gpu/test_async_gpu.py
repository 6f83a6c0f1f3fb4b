"""Asynchronous collectives on a GPU, as NCCL users expect them: 2 ranks on the cuda_ipc
workspace (they may share one GPU), the Triton and CUDA C++ program kernels.

- Blocking collectives issued from two streams, alternately, stay correct: each launches on the
  caller's stream after the communicator's previous one (gpucomm.workspace.stream_order), so they run in
  the order of the calls.
- A tensor dropped right after an asynchronous call is not handed out again before the
  collective has finished with it (a fresh allocation of the same size keeps its poison).
- DDP on the gpucomm backend overlaps its bucket all-reduces with the backward pass: a rank's
  backward returns while its peer has not even started, and the parameters match DDP on gloo.

Skipped without CUDA and CuPy.
"""

from __future__ import annotations

import time

import pytest
from cuda_group import NEEDS_CUDA_IPC, init_cuda_group
from spawn import run_ranks

pytestmark = NEEDS_CUDA_IPC

KERNELS = ("triton", "cuda")
WORLD = 2


def _two_streams(rank: int, world_size: int, kernels: str) -> list[str]:
    import torch

    import gpucomm

    device = init_cuda_group(rank, kernels)
    streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
    failures = []
    tensors = [torch.empty(4096, device=device) for _ in range(8)]
    for t in tensors:  # warm-up: one program per buffer
        gpucomm.all_reduce(t)
    for k, t in enumerate(tensors):
        with torch.cuda.stream(streams[k % 2]):
            torch.cuda._sleep(1_000_000 * (k % 3))  # the two streams drift apart
            t.fill_(float(rank + k))
            gpucomm.all_reduce(t)
            t.mul_(2)  # after the collective, in this stream's order
    torch.cuda.synchronize()
    for k, t in enumerate(tensors):
        expected = 2 * sum(r + k for r in range(world_size))
        if not torch.equal(t, torch.full_like(t, float(expected))):
            failures.append(f"rank {rank}: tensor {k} holds {t[:4].tolist()}, expected {expected}")
    gpucomm.destroy_process_group()
    return failures


@pytest.mark.parametrize("kernels", KERNELS)
def test_collectives_from_two_streams_stay_correct(kernels: str) -> None:
    for failures in run_ranks(_two_streams, WORLD, kernels, timeout=600):
        assert not failures, failures


def _dropped_tensor(rank: int, world_size: int, kernels: str) -> list[str]:
    import torch

    import gpucomm

    device = init_cuda_group(rank, kernels)
    n = 1 << 18
    warm = torch.ones(n, device=device)
    gpucomm.all_reduce(warm)  # builds the program of this size (the allocator hands the same block back)
    del warm
    failures = []
    if rank == 1:
        time.sleep(1.0)  # rank 0's collective stays in flight meanwhile
    x = torch.full((n,), float(rank + 1), device=device)
    work = gpucomm.all_reduce(x, async_op=True)
    if rank == 0:
        del x  # only the Work (and the watchdog) still hold it
        poison = torch.full((n,), 777.0, device=device)  # would take x's block if it were free
        work.wait()
        torch.cuda.synchronize()
        if not torch.equal(poison, torch.full_like(poison, 777.0)):
            failures.append("rank 0: the collective wrote into a new allocation: its tensor was freed early")
    else:
        work.wait()
        if not torch.equal(x, torch.full_like(x, float(sum(range(1, world_size + 1))))):
            failures.append(f"rank 1: all_reduce gave {x[:4].tolist()}: rank 0's buffer was reused early")
    gpucomm.destroy_process_group()
    return failures


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_tensor_dropped_after_an_async_call_is_not_reused_early(kernels: str) -> None:
    for failures in run_ranks(_dropped_tensor, WORLD, kernels, timeout=600):
        assert not failures, failures


def _ddp_overlap(rank: int, world_size: int, kernels: str, tmp: str) -> dict:
    import os

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gpucomm  # noqa: F401  registers the "gpucomm" backend

    os.environ["GPUCOMM_KERNELS"] = kernels
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)

    def train(backend: str, on: torch.device) -> tuple[dict, list[float]]:
        dist.init_process_group(backend, init_method=f"file://{tmp}/{backend}", rank=rank, world_size=world_size)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).to(on)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.25)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        backward_s = []
        for step in range(4):
            loss = ddp(torch.randn(64, 256, generator=gen).to(on)).square().mean()
            if rank == 1 and step > 0:
                time.sleep(0.5)  # rank 0's buckets cannot complete before this rank's backward
            start = time.monotonic()
            loss.backward()
            backward_s.append(time.monotonic() - start)
            opt.step()
            opt.zero_grad()
        params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        dist.destroy_process_group()
        return params, backward_s

    ours, backward_s = train("gpucomm", device)
    reference, _ = train("gloo", device)
    worst = max(((ours[k] - reference[k]).abs().max() / reference[k].abs().max()).item() for k in ours)
    return {"backward_s": backward_s, "worst_rel_diff": worst}


@pytest.mark.parametrize("kernels", KERNELS)
def test_ddp_backward_overlaps_the_bucket_all_reduces(kernels: str, tmp_path) -> None:
    results = run_ranks(_ddp_overlap, WORLD, kernels, str(tmp_path), timeout=600)
    # Rank 0's backward queues every bucket's all-reduce and returns while rank 1 sleeps 0.5 s
    # before its own: the host never waits for the peer there.
    assert max(results[0]["backward_s"][1:]) < 0.25, results[0]["backward_s"]
    for r in results:
        assert r["worst_rel_diff"] < 1e-5, r
