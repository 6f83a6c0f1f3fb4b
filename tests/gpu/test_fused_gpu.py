"""gpucomm.fused and the one-shot written with gpucomm.language on CUDA tensors over the cuda_ipc
workspace (several ranks may share one GPU): tests/fused/test_fused.py's comparisons, and the one-shot
against the program kernel's bits (tests/language/test_language.py's). Skipped without CUDA and CuPy."""

from __future__ import annotations

import random

import pytest
from fused_ranks import fused_against_unfused
from spawn import run_ranks

from gpucomm.transport import cuda_ipc_available

_OK, _WHY = cuda_ipc_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_ops_against_the_unfused_calls_on_cuda(world_size: int) -> None:
    seed = random.randrange(1 << 30)
    results = run_ranks(fused_against_unfused, world_size, seed, "cuda", timeout=600)
    assert results == [[]] * world_size, f"seed {seed}: {results}"
