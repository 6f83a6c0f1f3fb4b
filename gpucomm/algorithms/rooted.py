"""Rooted collectives on the workspace: broadcast, reduce, gather and scatter.

Broadcast and reduce are direct, spread (scatter + all-gather, reduce-scatter + gather:
gpucomm.algorithms.spread) or tree, gather and scatter direct. Roots are communicator ranks;
on the flat workspace they are local ranks too.

direct broadcast (per piece of one half): the root copies its piece into its half; one sync
(root: ``readers`` = everyone; others: ``sources`` = [root]); every other rank copies the piece
from the root's half. The root's memory serves P-1 readers at once.

direct reduce (per piece): every rank but the root copies its piece into its half; one sync
(others: ``readers`` = [root]; root: ``sources`` = everyone); the root reduces all P pieces in
rank order (its own straight from its tensor) into its tensor, rounding once.

gather (per piece): like reduce, with P-1 copies at the root instead of a reduce.

scatter (per piece of a P-th of a half per rank): the root copies piece i of ``inputs[i]``
into sub-slot i of its half; one sync; rank i copies sub-slot i.

tree broadcast and tree reduce: :mod:`gpucomm.algorithms.tree`.

The non-root ranks of gather, reduce and broadcast wait for nobody in their step (they only
signal, or only wait for the root): the carry-over of the builder makes their next write wait
for the root's reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpucomm.algorithms import spread, tree
from gpucomm.algorithms._pieces import count, piece, ranges
from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp

if TYPE_CHECKING:
    from gpucomm.ops.program import Builder

__all__ = ["broadcast", "reduce", "gather", "scatter"]


def _roles(b: Builder, root: int) -> tuple[bool, list[int]]:
    me = b.rank
    return me == root, [p for p in b.peers() if p != me]


def broadcast(algo: str, b: Builder, tensor: torch.Tensor, root: int) -> None:
    if algo == "tree":
        tree.broadcast_down(b, Region.of(tensor), root)
        return
    if algo == "spread":
        spread.broadcast(b, tensor, root)
        return
    is_root, others = _roles(b, root)
    whole = Region.of(tensor)
    for start, nbytes in ranges(whole.nbytes, b.half_bytes):
        mine = whole.sub(start, nbytes)
        offset = b.write_offset()
        if is_root:
            b.copy(b.slot(root, offset, nbytes), mine)
        b.sync(sources=[] if is_root else [root], readers=others if is_root else [])
        if not is_root:
            b.copy(mine, b.slot(root, offset, nbytes))


def reduce(algo: str, b: Builder, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
    whole = Region.of(tensor)
    if algo == "tree":
        tree.reduce_up(b, whole, whole, tensor.dtype, op, root)
        return
    if algo == "spread":
        spread.reduce(b, tensor, root, op)
        return
    is_root, others = _roles(b, root)
    size = tensor.element_size()
    for start, n in ranges(tensor.numel(), b.half_bytes // size):
        mine = whole.sub(start * size, n * size)
        offset = b.write_offset()
        if not is_root:
            b.copy(b.slot(b.rank, offset, mine.nbytes), mine)
        b.sync(sources=others if is_root else [], readers=[] if is_root else [root])
        if is_root:
            srcs = [mine if p == root else b.slot(p, offset, mine.nbytes) for p in b.peers()]
            b.reduce(mine, srcs, tensor.dtype, op, b.world_size)


def gather(b: Builder, tensor: torch.Tensor, outputs: Sequence[torch.Tensor] | None, root: int) -> None:
    is_root, others = _roles(b, root)
    whole = Region.of(tensor)
    outs = [Region.of(t) for t in outputs] if is_root and outputs is not None else []
    for start, nbytes in ranges(whole.nbytes, b.half_bytes):
        offset = b.write_offset()
        if not is_root:
            b.copy(b.slot(b.rank, offset, nbytes), whole.sub(start, nbytes))
        b.sync(sources=others if is_root else [], readers=[] if is_root else [root])
        if is_root:
            for p in b.spread():
                if p != root:
                    b.copy(outs[p].sub(start, nbytes), b.slot(p, offset, nbytes))
    # The root's own entry last, after the first sync: ranks whose calls differ raise there,
    # before anything is written into the caller's tensors.
    if is_root:
        b.copy(outs[root], whole)


def scatter(b: Builder, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] | None, root: int) -> None:
    is_root, others = _roles(b, root)
    me, P = b.rank, b.world_size
    whole = Region.of(tensor)
    ins = [Region.of(t) for t in inputs] if is_root and inputs is not None else []
    # Every destination's piece has the same size, so sub-slot i starts at i * piece bytes:
    # all ranks agree on where theirs is without a header.
    cap = b.half_bytes // P // 16 * 16  # 16-byte aligned sub-slots
    for t in range(count([whole.nbytes], cap)):
        mine = piece(whole, t, cap)
        offset = b.write_offset()
        b.reserve(offset, P * mine.nbytes)  # the root writes every sub-slot, rank i reads one
        if is_root:
            for i in others:
                b.copy(b.slot(me, offset + i * mine.nbytes, mine.nbytes), piece(ins[i], t, cap))
        b.sync(sources=[] if is_root else [root], readers=others if is_root else [])
        if not is_root:
            b.copy(mine, b.slot(root, offset + me * mine.nbytes, mine.nbytes))
    if is_root:  # its own piece after the first sync, as gather's
        b.copy(whole, ins[root])
