"""Symmetric tensors on CUDA (tests/workspace/test_symmetric.py's matrix on the cuda_ipc workspace), and the
multimem all_reduce where the node has NVLink SHARP. Skipped without CUDA and CuPy; the multimem
test also where the engine reports a reason (one GPU shared by the ranks, no cuda.bindings, no
multicast support), and it says which.
"""

from __future__ import annotations

import random

import pytest
import torch
from cuda_group import NEEDS_CUDA_IPC, init_cuda_group
from spawn import run_ranks
from symmetric_ranks import every_collective_symmetric_and_ordinary

pytestmark = NEEDS_CUDA_IPC


@pytest.mark.parametrize("kernels", ["triton", "cuda", "torch"])
def test_every_collective_on_symmetric_cuda_tensors(kernels: str) -> None:
    seed = random.randrange(1 << 30)
    results = run_ranks(
        every_collective_symmetric_and_ordinary,
        2,
        seed,
        kernels,
        (7, 4099, 10000),
        (torch.float32, torch.bfloat16, torch.int64),
        "cuda",
        timeout=900,
    )
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:20])


def _multimem(rank: int, world_size: int, seed: int) -> tuple[str, list[str]]:
    import warnings

    import gpucomm
    from gpucomm.reduce_op import ReduceOp

    device = init_cuda_group(rank, "triton")
    world = gpucomm.get_default_communicator()
    world.heap()  # the heap, and its multicast object, open at the first call that needs them
    reason = world._engines["cuda"].multimem.reason
    bad: list[str] = []
    if reason:
        gpucomm.destroy_process_group()
        return reason, bad
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mm = world.new_subgroup(list(range(world_size)), algo="multimem")
    for dtype, op in (
        (torch.int32, ReduceOp.SUM),
        (torch.int64, ReduceOp.MAX),
        (torch.float32, ReduceOp.SUM),
        (torch.bfloat16, ReduceOp.SUM),
    ):
        gen = torch.Generator().manual_seed(seed + rank)
        x = (torch.randint(-1000, 1000, (1 << 16,), generator=gen)).to(dtype).to(device)
        sym, plain = mm.empty(x.numel(), dtype=dtype, device=device), x.clone()
        sym.copy_(x)
        mm.all_reduce(sym, op)
        world.all_reduce(plain, op)
        torch.cuda.synchronize()
        # Integers are exact in any order; small integers in floats too (every partial sum exact).
        if not torch.equal(sym, plain):
            bad.append(f"rank {rank}: multimem {dtype} {op.name} differs from the program kernel's")
    mm.close()
    gpucomm.destroy_process_group()
    return "", bad


def test_multimem_all_reduce_where_the_node_has_nvlink_sharp() -> None:
    seed = random.randrange(1 << 30)
    results = run_ranks(_multimem, 2, seed, timeout=600)
    reasons = {reason for reason, _ in results}
    if reasons != {""}:
        pytest.skip(f"no multimem here: {sorted(reasons)}")
    failures = [f for _, bad in results for f in bad]
    assert not failures, "\n".join(failures)
