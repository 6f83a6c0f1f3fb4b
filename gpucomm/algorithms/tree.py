"""Binary trees over the ranks, and the two pipelined tree schedules built on them.

The tree is a heap on ranks renumbered from the root, v = (rank - root) mod P: v's children are
2v+1 and 2v+2, its depth floor(log2(v+1)), the tree's height D = depth(P-1). Any P works.

Both schedules cut the data into pieces of one half and run P-independent rounds
(gpucomm.ops.program: data written in round k is read in round k+1):

- ``reduce_up``: a node at depth d produces its partial of piece p in round p + D - d: a leaf
  copies its piece into its half, an inner node reduces ``[mine, child 1, child 2]`` (the
  children's partials of round p + D - d - 1) into its half, the root into ``out``. So the
  partials of one piece climb one level per round while the next pieces follow one round
  behind: n + D - 1 syncs for n pieces. Sync k: ``sources`` = my children when they produced
  a piece in round k, ``readers`` = my parent when I did; the two conditions are the same
  statement seen from either end, so signal and wait sets match.
- ``broadcast_down``: the root writes piece p in round p; a node at depth d reads piece p from
  its parent in round p + d, copies it into its half (for its children) and into ``region``.
  n + D - 1 syncs.

A node only ever waits for its parent and children, and writes only its own half. Partials are
stored in the data's dtype, so 16-bit floats are rounded once per level.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpucomm.algorithms._pieces import itemsize, partial_op, ranges
from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp

if TYPE_CHECKING:
    from gpucomm.ops.program import Builder

__all__ = ["Heap", "reduce_up", "broadcast_down"]


class Heap:
    """``rank``'s place in the binary heap of ``world_size`` ranks rooted at ``root``."""

    def __init__(self, world_size: int, root: int, rank: int) -> None:
        v = (rank - root) % world_size
        self.depth = (v + 1).bit_length() - 1
        self.height = world_size.bit_length() - 1  # depth of v = P - 1
        self.parent = None if v == 0 else ((v - 1) // 2 + root) % world_size
        self.children = [(c + root) % world_size for c in (2 * v + 1, 2 * v + 2) if c < world_size]


def reduce_up(b: Builder, src: Region, out: Region | None, dtype: torch.dtype, op: ReduceOp, root: int) -> None:
    """Reduce every rank's ``src`` into the root's ``out`` (``out`` may be ``src``).

    Other ranks' ``out`` is not touched.
    """
    me, P = b.rank, b.world_size
    heap = Heap(P, root, me)
    size = itemsize(dtype)
    pieces = ranges(src.nbytes // size, b.half_bytes // size)
    n, lag = len(pieces), heap.height - heap.depth
    for rnd in range(n + heap.height):
        p = rnd - lag  # the piece I produce in this round
        if 0 <= p < n:
            start, count = pieces[p]
            mine = src.sub(start * size, count * size)
            kids = [b.slot(c, b.read_offset(), mine.nbytes) for c in heap.children]
            if heap.parent is None:
                b.reduce(out.sub(start * size, count * size), [mine, *kids], dtype, op, P)
            elif kids:
                b.reduce(b.slot(me, b.write_offset(), mine.nbytes), [mine, *kids], dtype, partial_op(op), P)
            else:
                b.copy(b.slot(me, b.write_offset(), mine.nbytes), mine)
        if rnd < n + heap.height - 1:
            children_produce = 0 <= rnd + 1 - lag < n  # children made piece rnd+1-lag in this round
            b.sync(
                sources=heap.children if children_produce else [],
                readers=[heap.parent] if heap.parent is not None and 0 <= p < n else [],
            )


def broadcast_down(b: Builder, region: Region, root: int, unit: int = 1) -> None:
    """Copy the root's ``region`` into every rank's ``region`` (bytes), in pieces of whole ``unit`` bytes.

    After :func:`reduce_up` on the same region, ``unit`` must be its element size: then every piece
    has the bounds of reduce_up's, so that the channel that wrote a byte of the root's result is
    the channel that sends it on (channels of one rank never wait for each other). Cut in bytes
    instead, 4099 float64 in two pieces broke at byte 16396 here and at element 2050 there, and
    the second piece's first bytes were sent before another channel had reduced them.
    """
    me, P = b.rank, b.world_size
    heap = Heap(P, root, me)
    pieces = [(s * unit, c * unit) for s, c in ranges(region.nbytes // unit, b.half_bytes // unit)]
    n, d = len(pieces), heap.depth
    for rnd in range(n + heap.height):
        p = rnd - d  # the piece I handle in this round
        if 0 <= p < n:
            start, count = pieces[p]
            mine = region.sub(start, count)
            if heap.parent is None:
                if heap.children:
                    b.copy(b.slot(me, b.write_offset(), count), mine)
            else:
                received = b.slot(heap.parent, b.read_offset(), count)
                if heap.children:
                    forward = b.slot(me, b.write_offset(), count)
                    b.copy(forward, received)
                    b.copy(mine, forward)
                else:
                    b.copy(mine, received)
        if rnd < n + heap.height - 1:
            b.sync(
                sources=[heap.parent] if heap.parent is not None and 0 <= rnd + 1 - d < n else [],
                readers=heap.children if 0 <= p < n else [],
            )
