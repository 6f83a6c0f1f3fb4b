"""Every collective × algorithm on CUDA tensors over the cuda_ipc workspace (several ranks may
share one GPU), with the Triton, CUDA C++ and torch kernels: the matrix of
tests/workspace/test_workspace_collectives.py, checked the same way. Skipped without CUDA and CuPy.
"""

from __future__ import annotations

import random

import pytest
import torch
from collective_matrix import workspace_rank
from collective_plans import WORKSPACE, check_results, labels_of, torch_plan
from spawn import run_ranks

from gpucomm.transport import cuda_ipc_available

_OK, _WHY = cuda_ipc_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")


@pytest.mark.parametrize("kernels", ["triton", "cuda", "torch"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_collective_and_algorithm_on_cuda(world_size: int, kernels: str) -> None:
    seed = random.randrange(1 << 30)
    knobs = {"transport": "cuda_ipc", "kernels": kernels, "workspace_bytes": WORKSPACE, "timeout": 120}
    plan = torch_plan(world_size)
    # The inter-node stage uses NCCL for CUDA tensors, and NCCL refuses two ranks on one GPU:
    # pretend nodes only where every rank has its own GPU.
    if torch.cuda.device_count() < world_size:
        plan = [entry for entry in plan if entry[1] != "hierarchical"]
    results = run_ranks(workspace_rank, world_size, seed, "cuda", knobs, plan, timeout=900)
    check_results(results, seed, labels_of(plan), kernels=kernels)
