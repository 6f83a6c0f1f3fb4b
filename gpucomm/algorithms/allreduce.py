"""all_reduce on the workspace: one-shot, two-shot, ring and tree.

Rounds, halves and the ``sync(sources, readers)`` contract are the engine's (gpucomm.engine):
data written between two syncs is read by its readers after the next one, and only then.

one-shot (per piece of up to one half): copy my piece into my half; sync with all; every rank
reduces all P halves, in rank order, straight into its own tensor. One sync per piece.

two-shot (per piece of up to one half): copy in; sync with all; rank r reduces slice r of all
P halves into slice r of its *other* half (reduce-scatter); sync with all; every rank copies
slice p from rank p (all-gather). Two syncs per piece.

ring (per piece of up to P halves, cut into P chunks; q-1 and q+1 are the neighbours):
reduce-scatter in P steps, step t handling chunk c = q-1-t: step 0 copies my chunk into my
half, step t >= 1 is one fused launch ``half[q] = reduce(half[q-1], mine[c])``; after step
P-1 rank q holds chunk q reduced over all ranks (the fold starts at rank c+1 and goes round
the ring). All-gather in P-1 steps: rank q copies the chunk q-1 just received (or reduced) into
its half and into its tensor. Every step ends with ``sync(sources=[q-1], readers=[q+1])``:
2(P-1) syncs per piece, and only neighbours ever wait for each other, so the ranks run up to
one step apart and piece k+1's first steps overlap piece k's last ones on the other ranks.
Why a neighbour-only step may write its half: the half it writes last held data of two steps
back, which only q+1 read, and the carry-over of the previous sync waited for q+1 to finish
that read (engine docstring).

tree: :func:`gpucomm.algorithms.tree.reduce_up` to rank 0, then
:func:`gpucomm.algorithms.tree.broadcast_down` from it (binary heap, pipelined by pieces).

Every rank ends with bitwise the same bytes: one-shot folds the same sources in the same order
everywhere; two-shot, ring and tree compute each element once and copy it. Ring and tree store
their partial results in the tensor's dtype, so 16-bit floats are rounded at every step (P-1
times for ring, once per tree level), as NCCL's ring does; one-shot and two-shot round once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpucomm.algorithms import tree
from gpucomm.algorithms._pieces import partial_op, ranges
from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp

if TYPE_CHECKING:
    from gpucomm.engine import Engine

__all__ = ["run", "oneshot", "twoshot", "ring", "tree_all_reduce"]


def run(algo: str, engine: Engine, tensor: torch.Tensor, op: ReduceOp) -> None:
    {"oneshot": oneshot, "twoshot": twoshot, "ring": ring, "tree": tree_all_reduce}[algo](engine, tensor, op)


def oneshot(engine: Engine, tensor: torch.Tensor, op: ReduceOp) -> None:
    size = tensor.element_size()
    whole = Region.of(tensor)
    everyone = engine.peers()
    for start, count in ranges(tensor.numel(), engine.half_bytes // size):
        mine = whole.sub(start * size, count * size)
        offset = engine.write_offset()
        engine.kernels.copy(engine.slot(engine.rank, offset, mine.nbytes), mine)
        engine.sync(everyone, everyone)
        slots = [engine.slot(p, offset, mine.nbytes) for p in everyone]
        engine.kernels.reduce(mine, slots, tensor.dtype, op, engine.world_size)


def twoshot(engine: Engine, tensor: torch.Tensor, op: ReduceOp) -> None:
    size = tensor.element_size()
    whole = Region.of(tensor)
    everyone = engine.peers()
    P, me = engine.world_size, engine.rank
    for start, count in ranges(tensor.numel(), engine.half_bytes // size):
        mine = whole.sub(start * size, count * size)
        staged = engine.write_offset()
        engine.kernels.copy(engine.slot(me, staged, mine.nbytes), mine)
        engine.sync(everyone, everyone)
        bounds = [count * p // P * size for p in range(P + 1)]
        lo, hi = bounds[me], bounds[me + 1]
        reduced = engine.write_offset()
        slices = [engine.slot(p, staged + lo, hi - lo) for p in everyone]
        engine.kernels.reduce(engine.slot(me, reduced + lo, hi - lo), slices, tensor.dtype, op, P)
        engine.sync(everyone, everyone)
        for p in everyone:
            lo, hi = bounds[p], bounds[p + 1]
            engine.kernels.copy(mine.sub(lo, hi - lo), engine.slot(p, reduced + lo, hi - lo))


def ring(engine: Engine, tensor: torch.Tensor, op: ReduceOp) -> None:
    P, q = engine.world_size, engine.rank
    if P == 1:
        oneshot(engine, tensor, op)
        return
    size = tensor.element_size()
    whole = Region.of(tensor)
    prev, nxt = (q - 1) % P, (q + 1) % P
    k = engine.kernels

    def step() -> None:
        engine.sync([prev], [nxt])

    for start, count in ranges(tensor.numel(), P * (engine.half_bytes // size)):
        bounds = [(start + count * i // P) * size for i in range(P + 1)]
        chunk = [whole.sub(bounds[i], bounds[i + 1] - bounds[i]) for i in range(P)]
        # reduce-scatter
        first = chunk[(q - 1) % P]
        k.copy(engine.slot(q, engine.write_offset(), first.nbytes), first)
        step()
        for t in range(1, P):
            c = (q - 1 - t) % P
            last = t == P - 1
            partial = engine.slot(prev, engine.read_offset(), chunk[c].nbytes)
            out = engine.slot(q, engine.write_offset(), chunk[c].nbytes)
            k.reduce(out, [partial, chunk[c]], tensor.dtype, op if last else partial_op(op), P)
            if last:
                k.copy(chunk[c], out)
            step()
        # all-gather
        for t in range(1, P):
            c = (q - t) % P
            received = engine.slot(prev, engine.read_offset(), chunk[c].nbytes)
            if t == P - 1:
                k.copy(chunk[c], received)
            else:
                forward = engine.slot(q, engine.write_offset(), chunk[c].nbytes)
                k.copy(forward, received)
                k.copy(chunk[c], forward)
                step()


def tree_all_reduce(engine: Engine, tensor: torch.Tensor, op: ReduceOp) -> None:
    whole = Region.of(tensor)
    tree.reduce_up(engine, whole, whole, tensor.dtype, op, root=0)
    tree.broadcast_down(engine, whole, root=0)
