"""DDP on gpucomm on CUDA: the tests of tests/distributed/test_ddp.py with CUDA tensors on the cuda_ipc
workspace, several ranks sharing one GPU, Triton and CUDA C++ kernels.

The reference is DDP on gloo with the same CUDA tensors: NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

# Collected again in this module, where `runs` below is the CUDA fixture.
from ddp_runs import (  # noqa: F401 (the tests shared with tests/distributed/test_ddp.py)
    Runs,
    check_script_under_torchrun,
    test_allreduce_hook_matches_gloo,
    test_backend_serves_ddp_setup_and_gradient_buckets,
    test_backend_trains_like_gloo,
    test_compressed_hooks_beat_torch,
    test_compressed_hooks_train,
    training_runs,
)
from spawn import run_ranks

from gpucomm.transport import cuda_ipc_available

_OK, _WHY = cuda_ipc_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")

ENV = {"GPUCOMM_TRANSPORT": "auto", "GPUCOMM_DEBUG": "INFO", "GPUCOMM_TIMEOUT": "120", "OMP_NUM_THREADS": "1"}


@pytest.fixture(
    scope="module", params=[(2, "triton"), (3, "triton"), (2, "cuda"), (3, "cuda")], ids=lambda p: f"{p[0]}ranks-{p[1]}"
)
def runs(request, tmp_path_factory) -> Runs:
    world_size, kernels = request.param
    seed = random.randrange(1 << 20)
    tmp = tmp_path_factory.mktemp(f"ddp{world_size}{kernels}")
    env = {**ENV, "GPUCOMM_KERNELS": kernels}
    return Runs(
        seed, run_ranks(training_runs, world_size, str(tmp), seed, "cuda", env=env, timeout=300), "cuda_ipc", kernels
    )


def test_ddp_train_script_on_cuda(tmp_path) -> None:
    # --ddp-backend gloo: DDP's own set-up on gloo, since NCCL refuses two ranks on one GPU
    env = {k: v for k, v in ENV.items() if k != "GPUCOMM_DEBUG"}
    check_script_under_torchrun(tmp_path, "cuda", env, hook_args=("--ddp-backend", "gloo"))


def test_backend_future_orders_a_side_stream(tmp_path) -> None:
    """A Work of the gpucomm backend, waited on from another stream, orders that stream after
    the collective's kernels (the Future records the stream the kernels ran on)."""
    results = run_ranks(_side_stream, 2, str(tmp_path), env={**ENV, "GPUCOMM_KERNELS": "triton"}, timeout=300)
    assert results == [True, True]


def _side_stream(rank: int, world_size: int, tmp: str) -> bool:
    import torch.distributed as dist

    import gpucomm  # noqa: F401  registers the "gpucomm" backend

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gpucomm", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size)
    n = 1 << 20
    t = torch.full((n,), float(rank + 1), device=device)
    torch.cuda._sleep(50_000_000)  # keep the current stream busy so that a missing wait shows
    work = dist.all_reduce(t, async_op=True)
    side = torch.cuda.Stream(device)
    with torch.cuda.stream(side):
        work.get_future().wait()
        total = t.sum()
    side.synchronize()
    ok = total.item() == n * world_size * (world_size + 1) / 2
    dist.destroy_process_group()
    return ok
