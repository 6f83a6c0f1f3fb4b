"""A COPY is one move (dst, src): the kernels copy operands[first + 1] into operands[first] and
nothing else, so a COPY of more moves must never reach a table. The one fused form is a COPY
that a REDUCE carries (flagged CARRIED), which is still one move."""

from __future__ import annotations

import pytest
import torch

from gpucomm.algorithms import allreduce
from gpucomm.config import DEFAULT_WORKSPACE_BYTES
from gpucomm.ops.contract import Region
from gpucomm.ops.program import CARRIED, COPY, Builder, Program, Slot, carried, operands
from gpucomm.reduce_op import ReduceOp
from gpucomm.workspace.device_executor import instruction_rows
from gpucomm.workspace.layout import DataLayout

HALF = DataLayout(DEFAULT_WORKSPACE_BYTES["cuda"]).half_bytes


def _two_shot(world: int, rank: int, nbytes: int) -> Program:
    tensor = torch.empty(nbytes // 4, dtype=torch.float32)  # never touched: nothing is launched
    b = Builder(rank, world, HALF, "all_reduce", (nbytes,), args=[Region.of(tensor)])
    allreduce.run("twoshot", b, tensor, ReduceOp.SUM)
    return b.finish()


def _slots(n: int) -> list[Slot]:
    return [Slot(0, 0, 64 * i, 64) for i in range(n)]


def test_a_copy_of_two_moves_is_refused_before_any_table() -> None:
    dst, src, dst2, src2 = _slots(4)
    with pytest.raises(ValueError, match=r"operands: a COPY is .*5 or 6 fields, got 7"):
        operands((COPY, 64, 0, dst, src, dst2, src2))
    program = Program("all_reduce", 0, None, instructions=[(COPY, 64, 0, dst, src, dst2, src2)])
    with pytest.raises(ValueError, match="got 7"):
        instruction_rows(program)


def test_a_sixth_field_that_is_not_carried_is_refused() -> None:
    dst, src, other = _slots(3)
    assert carried((COPY, 64, 0, dst, src, CARRIED))
    assert not carried((COPY, 64, 0, dst, src, other))
    with pytest.raises(ValueError, match="got 6"):
        operands((COPY, 64, 0, dst, src, other))


def test_builder_has_no_paired_copy() -> None:
    assert not hasattr(Builder, "copy_pair")


@pytest.mark.parametrize("nbytes", [1 << 20, 3 * HALF + 4096])
def test_two_shot_copies_are_single_moves_in_the_kernels_table(nbytes: int) -> None:
    # One piece (under a half) and pipelined (several pieces, copy-ins carried on the folds).
    for rank in range(4):
        program = _two_shot(4, rank, nbytes)
        copies = [ins for ins in program.instructions if ins[0] == COPY]
        assert copies
        assert all(len(operands(ins)) == 2 for ins in copies)
        rows = [row for row in instruction_rows(program) if row[0] == COPY]
        assert len(rows) == len(copies)
        assert {row[3] for row in rows} == {1}  # word 3: the sources of the one move
        if nbytes > HALF:
            assert any(carried(ins) for ins in copies)


def test_a_program_of_no_instructions_is_refused_before_any_table() -> None:
    with pytest.raises(ValueError, match="instruction_rows: expected a program of at least one instruction, got none"):
        instruction_rows(Program("all_reduce", 0, None, instructions=[]))
