"""all_reduce_into(output, input) on CUDA tensors: 2 ranks on the cuda_ipc workspace (they may share
one GPU), Triton and CUDA C++ kernels, every algorithm (a subgroup forced to each, and auto), sizes of
one piece and of many (16 KiB workspaces), float32 and bfloat16 with SUM, AVG and MAX: output
poisoned first, against a float64 reference, the input bitwise unchanged, the output bitwise
all_reduce's on a copy; output is input; an asynchronous call; repeated calls on one pair, the call
captured in a CUDA graph and replayed with fresh inputs, then eager again.

The rank body is tests/support/into_ranks.py's, which tests/comm/test_all_reduce_into.py runs on
CPU tensors in CI. One spawn per kernel family, every case inside it (a rank's set-up on a GPU takes
seconds). Skipped without CUDA and CuPy.
"""

from __future__ import annotations

import random

import pytest
from cuda_group import NEEDS_CUDA_IPC
from into_ranks import check_into_results, into_rank
from spawn import run_ranks

pytestmark = NEEDS_CUDA_IPC


@pytest.mark.parametrize("kernels", ["triton", "cuda"])
def test_all_reduce_into_on_the_gpu(kernels: str) -> None:
    seed = random.randrange(1 << 30)
    logs = check_into_results(run_ranks(into_rank, 2, seed, kernels, "cuda_ipc", "cuda", timeout=600), seed)
    # The out-of-place programs served some calls, and a capture took the copy first.
    assert "all_reduce_into: out-of-place program, algo=twoshot" in logs[0], logs[0][-4000:]
    assert "output.copy_(input), then in place (the call is staged, lazy or captured)" in logs[0], logs[0][-4000:]
