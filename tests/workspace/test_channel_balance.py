"""Every channel busy in every phase: the programs gpucomm builds, laid out on the program
kernel's channels by the executor's own rule (gpucomm.workspace.device_executor.channel_layout), give
each channel of a launch an even share of every phase's bytes.

A phase is the work between two SYNCs. Channels never wait for each other, but a SYNC waits for
the same channel of the peers, so a phase lasts as long as its busiest channel: a channel with
twice the mean is a phase at half speed. The programs are built for every rank of 2, 3, 4 and 8
ranks with the GPU's workspace (64 MiB: 24 MiB halves) and never run; the tensors are never
touched (torch.empty), so 1 GiB costs no memory.
"""

from __future__ import annotations

import pytest
import torch

from gpucomm.algorithms import allgather, allreduce, alltoall, reducescatter, rooted, select
from gpucomm.config import DEFAULT_WORKSPACE_BYTES
from gpucomm.ops.contract import Region
from gpucomm.ops.program import SYNC, Builder, Program
from gpucomm.ops.program import operands as program_operands
from gpucomm.reduce_op import ReduceOp
from gpucomm.workspace.channels import MAX_CHANNELS, shares
from gpucomm.workspace.device_executor import channel_layout
from gpucomm.workspace.layout import DataLayout

HALF = DataLayout(DEFAULT_WORKSPACE_BYTES["cuda"]).half_bytes
WORLDS = (2, 3, 4, 8)
# 4 KiB to 1 GiB, a factor of 4 apart, and sizes no power of two divides (a float32 element
# past a power of two, and 5 x 3 MiB + 36 B): slices and pieces that do not fall on granules.
SIZES = [4 << (10 + 2 * i) for i in range(11)] + [(1 << 20) + 4, 15 * (3 << 20) + 36]
TOLERANCE = 0.25  # the bound: every channel within 25% of an even share


def phases(program: Program, world: int) -> tuple[int, list[list[int]]]:
    """(grid, bytes each channel loads and stores in each phase of ``program``)."""
    grid, granule = channel_layout(program, world, MAX_CHANNELS)
    out: list[list[int]] = [[0] * grid]
    for ins in program.instructions:
        if ins[0] == SYNC:
            out.append([0] * grid)
            continue
        operands = len(program_operands(ins))  # a COPY (carried or not) has 2
        for c, share in enumerate(shares(ins[2], ins[1], grid, granule)):
            out[-1][c] += share * operands
    return grid, out


def _uneven(grid: int, phase: list[int]) -> bool:
    total = sum(phase)
    if grid == 1 or total == 0:
        return False
    mean = total / grid
    return max(phase) > (1 + TOLERANCE) * mean or min(phase) < (1 - TOLERANCE) * mean


def _builder(rank: int, world: int, name: str, nbytes: int, tensors: list[torch.Tensor], heap=None) -> Builder:
    return Builder(rank, world, HALF, name, (nbytes,), args=[Region.of(t) for t in tensors], heap=heap)


def _all_reduce(rank: int, world: int, nbytes: int) -> Program:
    """The program of what ``auto`` picks for an ordinary float32 tensor."""
    tensor = torch.empty(nbytes // 4, dtype=torch.float32)
    algo = select.choose("all_reduce", nbytes, world, "cuda_ipc", "auto")
    if algo == select.SMALL:
        # The small-message kernel is no program: its channels take contiguous, even shares of the
        # tensor by construction (kernels/triton/small.py); the engine's stand-in where it cannot
        # serve a call is the program one-shot, whose balance is what this checks.
        algo = "oneshot"
    b = _builder(rank, world, "all_reduce", nbytes, [tensor])
    allreduce.run(algo, b, tensor, ReduceOp.SUM)
    return b.finish()


def _all_reduce_symmetric(rank: int, world: int, nbytes: int) -> Program:
    """Two-shot in place on a symmetric tensor (what the engine runs above one half)."""
    tensor = torch.empty(nbytes // 4, dtype=torch.float32)
    span = -(-nbytes // (1 << 30)) * (4 << 30)  # the peers' heaps: addresses nothing else uses
    heap = [tensor.data_ptr() + (p - rank) * span for p in range(world)]
    b = _builder(rank, world, "all_reduce", nbytes, [tensor], heap=heap)
    allreduce.twoshot_symmetric(b, tensor, ReduceOp.SUM)
    return b.finish()


def _reduce_scatter(rank: int, world: int, nbytes: int) -> Program:
    source = torch.empty(nbytes // 4, dtype=torch.float32)
    out = torch.empty(nbytes // 4 // world, dtype=torch.float32)
    whole = Region.of(source)
    chunks = [whole.sub(i * out.numel() * 4, out.numel() * 4) for i in range(world)]
    b = _builder(rank, world, "reduce_scatter_tensor", nbytes, [source, out])
    reducescatter.direct(b, chunks, Region.of(out), torch.float32, ReduceOp.SUM, whole.sub(0, world * out.numel() * 4))
    return b.finish()


def _all_gather(rank: int, world: int, nbytes: int) -> Program:
    out = torch.empty(nbytes // 4, dtype=torch.float32)
    part = nbytes // 4 // world * 4
    whole = Region.of(out)
    outs = [whole.sub(i * part, part) for i in range(world)]
    b = _builder(rank, world, "all_gather_into_tensor", nbytes, [out])
    allgather.direct(b, outs[rank], outs)
    return b.finish()


def _broadcast(rank: int, world: int, nbytes: int) -> Program:
    tensor = torch.empty(nbytes // 4, dtype=torch.float32)
    b = _builder(rank, world, "broadcast", nbytes, [tensor])
    rooted.broadcast("direct", b, tensor, 0)
    return b.finish()


def _reduce(rank: int, world: int, nbytes: int) -> Program:
    tensor = torch.empty(nbytes // 4, dtype=torch.float32)
    b = _builder(rank, world, "reduce", nbytes, [tensor])
    rooted.reduce("direct", b, tensor, 0, ReduceOp.SUM)
    return b.finish()


BUILDS = {
    "all_reduce": _all_reduce,
    "all_reduce_symmetric": _all_reduce_symmetric,
    "reduce_scatter": _reduce_scatter,
    "all_gather": _all_gather,
    "broadcast": _broadcast,
    "reduce": _reduce,
}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("collective", sorted(BUILDS))
def test_every_channel_gets_an_even_share_of_every_phase(collective: str, world: int) -> None:
    build = BUILDS[collective]
    uneven = []
    for nbytes in SIZES:
        for rank in range(world):
            grid, work = phases(build(rank, world, nbytes), world)
            for i, phase in enumerate(work):
                if _uneven(grid, phase):
                    mean = sum(phase) / grid
                    spread = f"{min(phase) / mean:.2f}-{max(phase) / mean:.2f}"
                    uneven.append(f"{nbytes} B rank {rank} phase {i}: {grid} channels, {spread} x the mean")
                    break
    assert not uneven, "\n".join(uneven[:10])


def test_a_two_shot_reduce_scatter_runs_on_every_channel() -> None:
    """The case that started it: at 8 ranks the REDUCE of a two-shot covers this rank's 1/8
    slice, which the old rule (one contiguous 1/grid of the half per channel) gave to 4 of 32
    channels from 4 MiB and to 1 of 8 at 512 KiB."""
    for nbytes, grid in ((512 << 10, 8), (4 << 20, 32), (64 << 20, 32)):
        program = _all_reduce(3, 8, nbytes)
        assert channel_layout(program, 8, MAX_CHANNELS)[0] == grid
        reduce_phase = phases(program, 8)[1][1]
        assert min(reduce_phase) > 0 and max(reduce_phase) <= 1.25 * sum(reduce_phase) / grid


def test_pieces_are_even_and_keep_sixteen_byte_cuts() -> None:
    from gpucomm.algorithms._pieces import piece, ranges

    cut = ranges((64 << 20) // 4, HALF // 4)
    # All but the last of one size, the last short by less than 16 elements a piece.
    assert len(cut) == 3 and cut[0][1] == cut[1][1] and 0 <= cut[0][1] - cut[2][1] < 16 * 3
    assert all(start * 4 % 16 == 0 for start, _ in cut) and sum(n for _, n in cut) == (64 << 20) // 4
    # 1000 B in pieces of at most 300: four pieces of 252 B and the last 244 (cut at multiples
    # of 4, the largest of 1..16 dividing 300), not three of 300 and one of 100.
    region = Region(0, 1000, torch.empty(0, dtype=torch.uint8))
    parts = [piece(region, t, 300) for t in range(5)]
    assert [p.nbytes for p in parts] == [252, 252, 252, 244, 0]
    assert [p.addr for p in parts[:4]] == [0, 252, 504, 756]


def _scatter(rank: int, world: int, nbytes: int, root: int) -> Program:
    tensor = torch.empty(nbytes // 4, dtype=torch.float32)
    inputs = [torch.empty(nbytes // 4, dtype=torch.float32) for _ in range(world)] if rank == root else None
    b = _builder(rank, world, "scatter", nbytes, [tensor, *(inputs or [])])
    rooted.scatter(b, tensor, inputs, root)
    return b.finish()


def _all_to_all(rank: int, world: int, nbytes: int) -> list[Program]:
    """Both programs of an all_to_all whose ranks send different totals (rank r sends r + 1
    times ``nbytes`` to every rank): its two programs, announce and deliver."""
    sends = [(rank + 1) * nbytes] * world
    receives = [(p + 1) * nbytes for p in range(world)]
    ins = [torch.empty(n // 4, dtype=torch.float32) for n in sends]
    outs = [torch.empty(n // 4, dtype=torch.float32) for n in receives]
    sizes = torch.empty(2 * world, dtype=torch.int64)
    regions = [Region.of(t) for t in (*outs, *ins, sizes)]
    first = Builder(rank, world, HALF, "all_to_all", (nbytes,), args=regions)
    alltoall.announce(first, [Region.of(t) for t in outs], [Region.of(t) for t in ins], Region.of(sizes))
    matrix = [[(p + 1) * nbytes] * world + [(q + 1) * nbytes for q in range(world)] for p in range(world)]
    second = Builder(rank, world, HALF, "all_to_all", (nbytes,), args=regions)
    alltoall.deliver(
        second,
        [Region.of(t) for t in outs],
        [Region.of(t) for t in ins],
        alltoall.rounds(matrix, HALF, range(world), "all_to_all"),
    )
    return [first.finish(), second.finish()]


@pytest.mark.parametrize("world", (2, 3, 8))
def test_every_rank_lays_a_call_out_on_the_same_channels(world: int) -> None:
    """A byte of a half belongs to the same channel on every rank: the grid and the granule of
    a call's programs agree across ranks, also where the ranks touch different parts of the
    layout (scatter's root writes every sub-slot and rank i reads one; all_to_all's ranks send
    different totals). A peer's channel that wrote other bytes would release this channel's
    wait early (found by tests/reliability/test_failures.py's fuzz: scatter at 3 ranks on 2 channels)."""
    for nbytes in (16396, 1 << 20, 15 * (3 << 20) + 36):
        for root in range(world):
            layouts = {channel_layout(_scatter(r, world, nbytes, root), world, MAX_CHANNELS) for r in range(world)}
            assert len(layouts) == 1, (nbytes, root, layouts)
        for i in range(2):
            layouts = {channel_layout(_all_to_all(r, world, nbytes)[i], world, MAX_CHANNELS) for r in range(world)}
            assert len(layouts) == 1, (nbytes, i, layouts)
