"""Broadcast and reduce spread over every GPU's links: scatter + all-gather, reduce-scatter + gather.

The direct forms (gpucomm.algorithms.rooted) move everything through the root's one link: P - 1
readers of the root's half in broadcast (its outbound link carries (P - 1)·n), P - 1 halves read by
the root in reduce (its inbound link carries (P - 1)·n). Above the size where the model has them
ahead (gpucomm.algorithms.select), ``auto`` runs these instead, in pieces of one half:

broadcast (the P - 1 other ranks, in rank order, are the *helpers*, helper j owning slice j of
every piece, cut at 16-byte boundaries where the first piece's are): in round t the root copies
piece t into its half; helper j copies its slice of piece t - 1 out of the root's half into its
own (at the same in-half position), and copies every helper's slice of piece t - 2 out of that
helper's half into its tensor (its own from its own half), one owner a step starting at its own
rank (Builder.spread), the root's half being the owner of the step whose owner is the root. A sync
with all ends each round: pieces + 1 SYNCs in all. In step i every owner serves one reader: the
root the slice of one helper, a helper its slice to one other helper (the first data round, where
only the root holds anything, aside). Each link carries about one piece a round each way, against
P - 1 pieces for the root's in the direct form.

reduce (piece k): every rank copies its piece into its half; sync with all; rank r folds slice r
of every rank's half, in rank order, into its other half (two-shot's reduce-scatter,
gpucomm.algorithms.allreduce); sync with all; the root copies slice p out of rank p's half into
its tensor (its own slice from its own half), starting at its own next peer. The next piece's
copy-in shares that last round. Each element is folded once, over the P ranks in rank order in
the accumulation type and rounded once, AVG dividing by P at that fold: the bits of the direct
reduce (the kernel contract's ``reduce``). The other ranks' tensors are only read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpucomm.algorithms._pieces import ranges
from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp

if TYPE_CHECKING:
    from gpucomm.ops.program import Builder

__all__ = ["broadcast", "reduce"]

_ALIGN = 16  # bytes of one vector: slices start on one


def _slices(nbytes: int, parts: int, full: int) -> list[int]:
    """Bounds of ``parts`` slices of a piece of ``nbytes``, cut where a piece of ``full`` bytes is
    cut (so every piece's slice j sits at one in-half position), on 16-byte boundaries."""
    units = -(-full // _ALIGN)
    return [min(nbytes, units * j // parts * _ALIGN) for j in range(parts)] + [nbytes]


def broadcast(b: Builder, tensor: torch.Tensor, root: int) -> None:
    """Copy the root's ``tensor`` into every rank's (module docstring)."""
    whole = Region.of(tensor)
    me = b.rank
    everyone = b.peers()
    helpers = [p for p in everyone if p != root]
    pieces = [whole.sub(start, nbytes) for start, nbytes in ranges(whole.nbytes, b.half_bytes)]
    full = pieces[0].nbytes
    cuts = [_slices(piece.nbytes, len(helpers), full) for piece in pieces]

    def part(t: int, owner: int) -> tuple[int, int]:
        j = helpers.index(owner)
        return cuts[t][j], cuts[t][j + 1] - cuts[t][j]

    # Round t: the root stages piece t; each helper takes its slice of piece t - 1 from the root and
    # gathers the other helpers' slices of piece t - 2, one owner a step starting at its own rank.
    for t in range(len(pieces) + 2):
        if me == root:
            if t < len(pieces):
                b.copy(b.slot(me, b.write_offset(), pieces[t].nbytes), pieces[t])
        else:
            for p in b.spread():
                if p == root and 1 <= t <= len(pieces):
                    lo, n = part(t - 1, me)
                    b.copy(b.slot(me, b.write_offset() + lo, n), b.slot(root, b.read_offset() + lo, n))
                elif p != root and 2 <= t:
                    lo, n = part(t - 2, p)
                    b.copy(pieces[t - 2].sub(lo, n), b.slot(p, b.read_offset() + lo, n))
        if t < len(pieces) + 1:
            b.sync(everyone, everyone)


def reduce(b: Builder, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
    """Fold every rank's ``tensor`` into the root's (module docstring)."""
    size = tensor.element_size()
    whole = Region.of(tensor)
    me, P = b.rank, b.world_size
    everyone = b.peers()
    pieces = ranges(tensor.numel(), b.half_bytes // size)
    full = pieces[0][1]
    pending: list[tuple[Region, object]] = []  # the previous piece's gather at the root
    for start, count in pieces:
        mine = whole.sub(start * size, count * size)
        bounds = [min(count, full * p // P) * size for p in range(P)] + [count * size]
        for out, theirs in pending:
            b.copy(out, theirs)
        staged = b.write_offset()
        b.copy(b.slot(me, staged, mine.nbytes), mine)
        b.sync(everyone, everyone)
        lo, hi = bounds[me], bounds[me + 1]
        reduced = b.write_offset()
        b.reduce(
            b.slot(me, reduced + lo, hi - lo), [b.slot(p, staged + lo, hi - lo) for p in everyone], tensor.dtype, op, P
        )
        b.sync(everyone, everyone)
        pending = []
        if me == root:
            for p in b.spread():
                lo, n = bounds[p], bounds[p + 1] - bounds[p]
                pending.append((mine.sub(lo, n), b.slot(p, reduced + lo, n)))
    for out, theirs in pending:
        b.copy(out, theirs)
