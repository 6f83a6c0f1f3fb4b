"""Which SYNCs fence: a SYNC that announces data the rank's earlier kernels wrote (a symmetric
tensor read in place) carries the fence word, and no other does (docs/kernel-contract.md).

The programs are built, never run, for every rank of 2 and 4 ranks; the tables are the ones the
device executor uploads (gpucomm.workspace.device_executor.instruction_rows). The kernels' side,
a ``membar.sys`` before the release of a fenced SYNC, is checked in the PTX by
tests/ops/test_triton_aot.py and tests/ops/test_cuda_compile.py.
"""

from __future__ import annotations

import pytest
import torch

from gpucomm.algorithms import allreduce, symmetric
from gpucomm.ops.contract import Region
from gpucomm.ops.program import SYNC, Builder
from gpucomm.reduce_op import ReduceOp
from gpucomm.workspace.device_executor import instruction_rows

HALF = 1 << 20
NUMEL = 4096
WORLDS = (2, 4)


def _builder(rank: int, world: int, name: str, tensors: list[torch.Tensor], symmetric_heap: bool) -> Builder:
    heap = None
    if symmetric_heap:
        span = 1 << 30  # the peers' heaps: addresses nothing else uses
        heap = [tensors[0].data_ptr() + (p - rank) * span for p in range(world)]
    return Builder(rank, world, HALF, name, (NUMEL * 4,), args=[Region.of(t) for t in tensors], heap=heap)


def _fence_words(rank: int, world: int, build: str) -> list[int]:
    """The fence word of every SYNC row of a program, in order."""
    x = torch.empty(NUMEL, dtype=torch.float32)
    out = torch.empty(NUMEL * world, dtype=torch.float32)
    if build == "twoshot_symmetric":
        b = _builder(rank, world, "all_reduce", [x], True)
        allreduce.twoshot_symmetric(b, x, ReduceOp.SUM)
    elif build == "all_gather_symmetric":
        b = _builder(rank, world, "all_gather_into_tensor", [x, out], True)
        symmetric.all_gather_into_tensor(b, Region.of(out), x)
    elif build == "broadcast_symmetric":
        b = _builder(rank, world, "broadcast", [x], True)
        symmetric.broadcast(b, x, 0)
    else:  # the programs on the halves: they copy their input in themselves
        b = _builder(rank, world, "all_reduce", [x], False)
        allreduce.run(build, b, x, ReduceOp.SUM)
    return [row[3] for row in instruction_rows(b.finish()) if row[0] == SYNC]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("build", ["twoshot_symmetric", "all_gather_symmetric", "broadcast_symmetric"])
def test_first_sync_of_an_in_place_symmetric_program_fences(world: int, build: str) -> None:
    """The first SYNC announces every rank's input, written by earlier kernels: fenced; the later
    ones announce what the program itself wrote: not."""
    for rank in range(world):
        words = _fence_words(rank, world, build)
        assert words[0] == 1 and not any(words[1:]), (rank, words)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("build", ["oneshot", "twoshot", "ring"])
def test_programs_on_the_halves_fence_nothing(world: int, build: str) -> None:
    """A program on the halves copies its input in with its own blocks: a block barrier and the
    release order it, and no SYNC pays for a system-scope fence."""
    for rank in range(world):
        words = _fence_words(rank, world, build)
        assert words and not any(words), (rank, words)
