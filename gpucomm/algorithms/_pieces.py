"""Cutting user regions into the slot-sized pieces that one round moves.

A region is cut into as few pieces as fit (at most ``cap`` units each) and those pieces are as
even as 16-byte boundaries allow, never ``cap``-sized pieces and a short remainder: the program
kernel deals every instruction's bytes out to its channels in granules sized by the smallest
instruction (gpucomm.workspace.channels.granule), so a remainder piece would make the granules of every
other piece small, or leave their channels uneven.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp

__all__ = ["count", "piece", "ranges", "partial_op", "itemsize"]

# Bytes of one vector access: piece boundaries fall on multiples of it where ``cap`` allows.
_ALIGN = 16


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _bounds(total: int, cap: int) -> list[int]:
    """Boundaries of ``total`` units cut into ``ceil(total / cap)`` pieces (one for 0), each <= ``cap``.

    All but the last piece are of one size, a multiple of the largest of 1, 2, 4, 8, 16 units that
    divides ``cap``; the last is short of it by less than one such unit per piece. Equal pieces cut
    their slices alike, so that a slice sits at one in-half position in every piece (two-shot's
    pieces, gpucomm.algorithms.allreduce).
    """
    cap = max(1, cap)
    k = max(1, -(-total // cap))
    align = math.gcd(cap, _ALIGN)
    size = -(-total // (k * align)) * align  # <= cap: cap is a multiple of align
    return [min(total, size * i) for i in range(k + 1)]


def ranges(numel: int, cap: int) -> list[tuple[int, int]]:
    """(first element, count) of each even piece of at most ``cap`` elements (module docstring).

    One empty piece for 0.
    """
    bounds = _bounds(numel, cap)
    return [(lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])]


def count(sizes: Sequence[int], cap: int) -> int:
    """Pieces needed by the largest of ``sizes`` (units of ``cap``), at least one."""
    cap = max(1, cap)
    return max([1, *(-(-s // cap) for s in sizes)])


def piece(region: Region, index: int, cap: int, unit: int = 1) -> Region:
    """Piece ``index`` of ``region`` cut into even pieces of at most ``cap`` units of ``unit`` bytes.

    Empty past its last piece (module docstring).
    """
    bounds = _bounds(region.nbytes // unit, cap)
    if index >= len(bounds) - 1:
        return region.sub(region.nbytes, 0)
    return region.sub(bounds[index] * unit, (bounds[index + 1] - bounds[index]) * unit)


def partial_op(op: ReduceOp) -> ReduceOp:
    """The op of an intermediate step: AVG sums until the last step divides once."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op
