"""The host executor's copies and folds in pieces below torch's parallel grain
(gpucomm.reliability.host_threads): the same bits as whole ops, chosen only when torch's pool is wider than
this rank's share of the cores."""

from __future__ import annotations

import pytest
import torch

from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp
from gpucomm.reliability.host_threads import GRAIN, PIECE, ThreadFit, pieces
from gpucomm.workspace.host_executor import _bound_copy, _bound_reduce


class _Fixed(ThreadFit):
    def __init__(self, serial: bool) -> None:
        super().__init__(1, 1)
        self._serial = serial

    def serial(self) -> bool:
        return self._serial


def test_pieces_stay_below_the_grain_and_cover_the_tensor() -> None:
    t = torch.arange(3 * GRAIN + 5)
    parts = pieces(t)
    assert all(p.numel() < GRAIN for p in parts) and torch.equal(torch.cat(parts), t)
    assert all(p.data_ptr() % 64 == 0 for p in parts)  # every piece starts 64-byte aligned, as t does
    assert pieces(t[: GRAIN - 1])[0].numel() == GRAIN - 1 and PIECE < GRAIN


def test_serial_only_where_the_pool_is_wider_than_the_share() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ThreadFit(ranks_here=2, cores=2).serial()  # 2 threads, 1 core per rank
        assert not ThreadFit(ranks_here=1, cores=2).serial()  # 2 threads, 2 cores for the one rank
        torch.set_num_threads(1)
        assert not ThreadFit(ranks_here=4, cores=2).serial()  # one thread fits any share
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    "dtype,op",
    [
        (torch.float32, ReduceOp.SUM),
        (torch.float16, ReduceOp.AVG),
        (torch.bfloat16, ReduceOp.MAX),
        (torch.int32, ReduceOp.AVG),
        (torch.float64, ReduceOp.PRODUCT),
    ],
)
@pytest.mark.parametrize("aliased", [False, True])
def test_pieces_give_the_bits_of_whole_ops(dtype: torch.dtype, op: ReduceOp, aliased: bool) -> None:
    n = 2 * GRAIN + 4099
    gen = torch.Generator().manual_seed(1)
    srcs = [(torch.randn(n, generator=gen, dtype=torch.float64) * 8).to(dtype) for _ in range(3)]
    results = []
    for serial in (False, True):
        ins = [s.clone() for s in srcs]
        out = ins[1] if aliased else torch.empty(n, dtype=dtype)  # out may be a later source
        _bound_reduce(Region.of(out), [Region.of(s) for s in ins], dtype, op, 3, _Fixed(serial))()
        copied = torch.empty_like(out)
        _bound_copy(Region.of(copied), Region.of(out), _Fixed(serial))()
        results.append(copied)
    assert torch.equal(results[0].view(torch.uint8), results[1].view(torch.uint8))
