"""The out-of-place all_reduce programs (gpucomm.all_reduce_into) make no pass of their own.

Built and never run, for every rank, at 2, 3 and 8 ranks, in one piece, several pieces (two syncs a
piece) and pipelined: one-shot, two-shot and ring into ``output`` read the input (argument 0) only,
write the output (argument 1) only, never read the output back (no COPY or fold from it), and have
the in-place program's instructions exactly: the same opcodes, sizes and syncs, one for one.
"""

from __future__ import annotations

import pytest
import torch

from gpucomm.algorithms import allreduce
from gpucomm.ops.contract import Region
from gpucomm.ops.program import COPY, REDUCE, SYNC, Arg, Builder, carried
from gpucomm.reduce_op import ReduceOp

HALF = 6 << 10  # 16 KiB workspaces: 4099 float32 take 3 pieces, 20011 the pipelined two-shot


def _moves(ins: tuple) -> tuple[list, list]:
    """(destinations, sources) of a COPY or REDUCE."""
    if ins[0] == COPY:
        if carried(ins):
            return [ins[3]], [ins[4]]
        return list(ins[3::2]), list(ins[4::2])
    return [ins[3], *ins[7:]], list(ins[4])


def _build(rank: int, world: int, algo: str, n: int, into: bool):
    x, out = torch.empty(n), torch.empty(n)
    args = [Region.of(x), Region.of(out)] if into else [Region.of(x)]
    b = Builder(rank, world, HALF, "all_reduce", (algo,), args=args)
    allreduce.run(algo, b, x, ReduceOp.SUM, out if into else None)
    return b.finish()


def _shape(ins: tuple) -> tuple:
    """What an instruction costs: opcode, bytes and, for a REDUCE, how many sources and stores."""
    if ins[0] == SYNC:
        return (SYNC,)
    dsts, srcs = _moves(ins)
    return (ins[0], ins[1], len(dsts), len(srcs), carried(ins) if ins[0] == COPY else False)


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("n", [7, 4099, 20011])
@pytest.mark.parametrize("algo", allreduce.OUT_OF_PLACE)
def test_out_of_place_programs_read_the_input_write_the_output_and_add_no_pass(algo: str, n: int, world: int) -> None:
    for rank in range(world):
        into = _build(rank, world, algo, n, into=True)
        inplace = _build(rank, world, algo, n, into=False)
        # One for one the in-place program's instructions: no COPY more, no REDUCE more, no SYNC more.
        assert [_shape(i) for i in into.instructions] == [_shape(i) for i in inplace.instructions], (algo, rank)
        counts = {COPY: 0, REDUCE: 0}
        wrote_output = read_input = 0
        for ins in into.instructions:
            if ins[0] == SYNC:
                continue
            counts[ins[0]] += 1
            dsts, srcs = _moves(ins)
            for s in srcs:
                assert not (isinstance(s, Arg) and s.index == 1), f"{algo} rank {rank}: reads the output: {ins}"
                read_input += isinstance(s, Arg) and s.index == 0
            for d in dsts:
                assert not (isinstance(d, Arg) and d.index == 0), f"{algo} rank {rank}: writes the input: {ins}"
                wrote_output += d.nbytes if isinstance(d, Arg) and d.index == 1 else 0
        assert counts[COPY] + counts[REDUCE] > 0 and read_input > 0
        # Every byte of the output is written, by a fold's store or the all-gather, once.
        assert wrote_output == 4 * n, (algo, rank, wrote_output)


def test_a_partial_overlap_is_refused_before_any_data_moves_without_a_group() -> None:
    from gpucomm.comm.reduce_into import check_into

    buf = torch.zeros(64)
    assert check_into(buf[:32], buf[:32], None) is True  # output is input: in place
    assert check_into(buf[32:], buf[:32], None) is False  # adjacent: no byte shared
    with pytest.raises(ValueError, match=r"gpucomm.all_reduce_into: output must be input itself .* at \+4 bytes"):
        check_into(buf[1:33], buf[:32], None)
    with pytest.raises(ValueError, match=r"gpucomm.all_reduce_into: output must have the shape of input, \(32,\)"):
        check_into(buf[:16], buf[:32], None)
