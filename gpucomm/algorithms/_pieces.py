"""Cutting user regions into the slot-sized pieces that one round moves."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp

__all__ = ["count", "piece", "ranges", "partial_op", "itemsize"]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def ranges(numel: int, cap: int) -> list[tuple[int, int]]:
    """(first element, count) of each piece of at most ``cap`` elements; one empty piece for 0."""
    cap = max(1, cap)
    return [(start, min(cap, numel - start)) for start in range(0, numel, cap)] or [(0, 0)]


def count(sizes: Sequence[int], cap: int) -> int:
    """Pieces needed by the largest of ``sizes`` (units of ``cap``), at least one."""
    cap = max(1, cap)
    return max([1, *(-(-s // cap) for s in sizes)])


def piece(region: Region, index: int, cap: int, unit: int = 1) -> Region:
    """Piece ``index`` of ``region`` cut every ``cap`` units of ``unit`` bytes (empty past its end)."""
    start = min(index * cap * unit, region.nbytes)
    return region.sub(start, min(cap * unit, region.nbytes - start))


def partial_op(op: ReduceOp) -> ReduceOp:
    """The op of an intermediate step: AVG sums until the last step divides once."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op
