"""Two-shot never copies a rank's own slice out of its half: the fold of slice r stores into rank r's
half (for the peers' all-gather) and into its tensor in one REDUCE (``Builder.reduce``'s ``also``,
the kernels' STORE_ALSO), in both schedules (one piece with two SYNCs, and pipelined).

Counted from every rank's program, built and never run (bench/programs.py), on the GPU's 24 MiB
halves and on small ones that make many pieces.
"""

from __future__ import annotations

import pytest
import torch

from gpucomm._bench import programs
from gpucomm.algorithms import allreduce
from gpucomm.ops.contract import Region
from gpucomm.ops.program import COPY, MAX_CARRIED, REDUCE, Arg, Builder, Slot, carried
from gpucomm.reduce_op import ReduceOp

HALF = 24 << 20


def _counts(program, rank: int) -> dict[str, int]:
    """REDUCEs with and without a second destination, and copies out of this rank's own half."""
    out = {"reduce_also": 0, "reduce_alone": 0, "own_copy_out": 0, "copy_out": 0}
    for ins in program.instructions:
        if carried(ins):
            continue  # a copy-in (tensor -> my half), carried by the fold before it
        if ins[0] == REDUCE:
            out["reduce_also" if len(ins) > 7 else "reduce_alone"] += 1
            if len(ins) > 7:
                # The second destination is the tensor's slice the fold read as its own source.
                assert isinstance(ins[7], Arg) and ins[7] == ins[4][rank], ins
        elif ins[0] == COPY:
            for dst, src in zip(ins[3::2], ins[4::2]):
                if isinstance(src, Slot) and not isinstance(dst, Slot):
                    out["copy_out"] += 1
                    out["own_copy_out"] += src.peer == rank
    return out


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("nbytes", [64 << 10, 64 << 20, 1 << 30])
def test_the_fold_stores_into_the_tensor_and_no_own_slice_is_copied_out(world: int, nbytes: int) -> None:
    for rank in range(world):
        program, _ = programs.build("all_reduce", nbytes, world, rank, HALF, algo="twoshot")
        c = _counts(program, rank)
        pieces = c["reduce_also"]  # one fold a piece (pipelined: a short first piece, then even ones)
        assert c["reduce_alone"] == 0 and pieces >= -(-nbytes // HALF), (rank, c)
        assert c["own_copy_out"] == 0, (rank, c)
        # Every peer's slice of every piece is still gathered, each by one copy: P - 1 a piece.
        assert c["copy_out"] == (world - 1) * pieces, (rank, c)


def test_the_pipelined_form_stores_twice_too() -> None:
    # 6 KiB halves, 80 KiB of float32: a first piece of 1.5 KiB, then 13: pipelined.
    tensor = torch.empty(20011)
    for rank in range(3):
        b = Builder(rank, 3, 6 << 10, "all_reduce", ("twoshot",), args=[Region.of(tensor)])
        allreduce.twoshot(b, tensor, ReduceOp.SUM)
        program = b.finish()
        assert program.syncs == 14 + 1  # one SYNC a piece, plus one
        c = _counts(program, rank)
        assert c == {"reduce_also": 14, "reduce_alone": 0, "own_copy_out": 0, "copy_out": 2 * 14}, (rank, c)


@pytest.mark.parametrize("world", [2, 3, 8])
def test_every_copy_in_but_the_first_rides_on_a_fold(world: int) -> None:
    """Pipelined (more than one piece): piece t's copy-in is carried by the fold of
    piece t - 1, as at most two COPYs flagged CARRIED right after it (the slices before the rank's
    own and those after it); only the first piece's copy-in runs alone."""
    nbytes = 64 << 20
    for rank in range(world):
        program, _ = programs.build("all_reduce", nbytes, world, rank, HALF, algo="twoshot")
        ins = program.instructions
        carried_bytes, plain_copy_in = 0, 0
        for i, one in enumerate(ins):
            if carried(one):
                back = next(j for j in range(i - 1, -1, -1) if not carried(ins[j]))
                assert ins[back][0] == REDUCE and i - back <= MAX_CARRIED, (rank, i)
                assert isinstance(one[3], Slot) and one[3].peer == rank and isinstance(one[4], Arg)
                carried_bytes += one[1]
            elif one[0] == COPY and isinstance(one[3], Slot):
                plain_copy_in += one[1]
        first = HALF // allreduce.FIRST_PIECE_SHARE
        assert carried_bytes == pytest.approx((nbytes - first) * (world - 1) / world, rel=1e-3), rank
        assert plain_copy_in == pytest.approx(first * (world - 1) / world, rel=1e-3), rank


def test_builder_reduce_refuses_a_second_destination_of_another_size() -> None:
    tensor = torch.empty(64)
    whole = Region.of(tensor)
    b = Builder(0, 2, 1 << 10, "all_reduce", (), args=[whole])
    with pytest.raises(ValueError, match=r"Builder.reduce: .*also.* 128 bytes"):
        b.reduce(whole.sub(0, 128), [whole.sub(0, 128)], torch.float32, ReduceOp.SUM, also=whole.sub(0, 64))
