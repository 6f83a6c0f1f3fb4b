"""all_reduce on the workspace: one-shot, two-shot, ring and tree.

Rounds, halves and the ``sync(sources, readers)`` contract are those of gpucomm.ops.program:
data written between two syncs is read by its readers after the next one, and only then.

one-shot (per piece of up to one half): copy my piece into my half; sync with all; every rank
reduces all P halves, in rank order, straight into its own tensor. One sync per piece.

two-shot (per piece of up to one half): copy in the P - 1 slices the peers fold; sync with all;
rank r reduces slice r of every rank's half (its own straight from its tensor) into slice r of
its *other* half (reduce-scatter); sync with all; every rank copies slice p from rank p
(all-gather). Two syncs per piece. The all-gather of a piece shares its round with the next
piece's copy-in, slice by slice in paired COPYs: the copy-in's local pass runs beside the
all-gather's link reads. Every per-peer loop starts at the rank's own next peer.

two-shot pipelined (from PIPELINED_MIN_PIECES pieces): one sync per piece. Round t reduces piece
t - 1 (staged in round t - 1), gathers piece t - 2 (reduced in round t - 1) and copies piece t in,
paired with that all-gather. Both kinds of data share a half: in the half of round t, rank r's slice
r holds its fold of piece t - 1, its other slices piece t's copy-in; no position is written twice in
a round, and every rank reads the peers' half of the last round only. Pieces + 1 syncs, against 2 per
piece; one copy-in more is exposed (round 1's, beside a reduce), so it leads only with many pieces.

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
that read (gpucomm.ops.program).

two-shot on a symmetric tensor (gpucomm.empty: every rank's copy at the same heap offset, mapped
by every rank): no copy in, no pieces, no copy out. Sync with all (every rank's input is there);
rank r reduces slice r of every rank's copy, in rank order, into slice r of its own tensor (no
other rank reads that slice of r's tensor in this round: rank q reads slice q); sync with all;
rank r copies slice p from rank p's tensor into its own; a last sync tells every rank that
nobody reads its tensor any more, so the caller may write it as soon as the call returns. Three
syncs per call whatever the size, against two per half-sized piece on the halves. Slices are cut
at 16-byte boundaries so that every access is a whole vector.

tree: :func:`gpucomm.algorithms.tree.reduce_up` to rank 0, then
:func:`gpucomm.algorithms.tree.broadcast_down` from it (binary heap, pipelined by pieces).

Every rank ends with bitwise the same bytes: one-shot folds the same sources in the same order
everywhere; two-shot, ring and tree compute each element once and copy it. Ring and tree store
their partial results in the tensor's dtype, so 16-bit floats are rounded at every step (P-1
times for ring, once per tree level), as NCCL's ring does; one-shot and two-shot round once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from gpucomm.algorithms import tree
from gpucomm.algorithms._pieces import partial_op, ranges
from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp

if TYPE_CHECKING:
    from gpucomm.ops.program import Builder

__all__ = ["run", "oneshot", "twoshot", "twoshot_symmetric", "ring", "tree_all_reduce"]


def run(algo: str, b: Builder, tensor: torch.Tensor, op: ReduceOp) -> None:
    {"oneshot": oneshot, "twoshot": twoshot, "ring": ring, "tree": tree_all_reduce}[algo](b, tensor, op)


def oneshot(b: Builder, tensor: torch.Tensor, op: ReduceOp) -> None:
    size = tensor.element_size()
    whole = Region.of(tensor)
    everyone = b.peers()
    for start, count in ranges(tensor.numel(), b.half_bytes // size):
        mine = whole.sub(start * size, count * size)
        offset = b.write_offset()
        b.copy(b.slot(b.rank, offset, mine.nbytes), mine)
        b.sync(everyone, everyone)
        slots = [b.slot(p, offset, mine.nbytes) for p in everyone]
        b.reduce(mine, slots, tensor.dtype, op, b.world_size)


# Two-shot pipelined from 6 pieces on: the model (both ends charged, 8 ranks, 0.82 x 450 GB/s,
# 24 MiB halves, the fold storing into my tensor too; python -m gpucomm._bench.model), device us two
# syncs a piece / pipelined: 3 pieces (64 MiB) 352.3 / 359.4, 5 pieces (120 MiB) 644.4 / 647.1,
# 6 pieces (128 MiB) 688.6 / 686.6, 43 pieces (1 GiB) 5367.8 / 5256.4; at 0.57 x 450 GB/s the same
# crossover (120 MiB 906.2 / 908.8, 128 MiB 967.8 / 965.8).
PIPELINED_MIN_PIECES = 6


def _two_shot_pieces(b: Builder, tensor: torch.Tensor) -> tuple[list[Region], Callable[[int, int], tuple[int, int]]]:
    """The pieces of a two-shot, and where slice p of piece t lies, (offset, bytes) in the piece
    and in the half.

    The even pieces of gpucomm.algorithms._pieces with the short one first, and every piece's
    slices cut at the bounds of a full piece, clipped to its own length: slice p sits at one
    in-half position in every piece, so each piece's copy-in pairs with the previous piece's
    all-gather over their common length, and where they differ (the first piece's last slice) what
    is left over is the copy-in's, a local copy, never a read of one peer by every rank.
    """
    size, P = tensor.element_size(), b.world_size
    counts = [count for _, count in ranges(tensor.numel(), b.half_bytes // size)][::-1]
    whole, full = Region.of(tensor), counts[-1]
    pieces = [whole.sub(sum(counts[:k]) * size, count * size) for k, count in enumerate(counts)]

    def part(t: int, p: int) -> tuple[int, int]:
        lo, hi = (min(counts[t], full * q // P) * size for q in (p, p + 1))
        hi = counts[t] * size if p == P - 1 else hi
        return lo, hi - lo

    return pieces, part


def twoshot(b: Builder, tensor: torch.Tensor, op: ReduceOp) -> None:
    pieces, part = _two_shot_pieces(b, tensor)
    if len(pieces) >= PIPELINED_MIN_PIECES:
        _twoshot_pipelined(b, tensor, op, pieces, part)
        return
    everyone = b.peers()
    P, me = b.world_size, b.rank
    # Per-peer loops start at my own rank (Builder.spread): in step i rank r reads rank r + i's slice,
    # so each GPU's outbound link serves one reader a step. The reduce keeps rank order.
    order = b.spread()
    gather: dict[int, tuple[Region, object]] = {}  # piece k-1's copies out, by peer: (my tensor's slice, its slot)
    for t, mine in enumerate(pieces):
        staged = b.write_offset()
        # My own slice is read by me alone (rank r folds slice r): the fold takes it from my tensor
        # and stores its result back there as well as into my half, so only the other P - 1 slices
        # are copied in, each paired with the all-gather's read of the same slice of the previous
        # piece, and my own slice is never copied out (a local copy alone in its step: 1.9 us a
        # piece at 64 MiB, 8 ranks, by the model).
        rests = []
        for p in order:
            dst, src = b.slot(me, staged + part(t, p)[0], part(t, p)[1]), mine.sub(*part(t, p))
            if p == me:
                continue
            if gather:
                rests += _copy_paired(b, *gather[p], dst, src)
            else:
                b.copy(dst, src)
        for dst, src in rests:  # after every pair, so that the ranks' k-th steps stay the same work
            b.copy(dst, src)
        b.sync(everyone, everyone)
        lo, n = part(t, me)
        reduced = b.write_offset()
        slices = [mine.sub(lo, n) if p == me else b.slot(p, staged + lo, n) for p in everyone]
        b.reduce(b.slot(me, reduced + lo, n), slices, tensor.dtype, op, P, also=mine.sub(lo, n))
        b.sync(everyone, everyone)
        gather = {p: (mine.sub(*part(t, p)), b.slot(p, reduced + part(t, p)[0], part(t, p)[1])) for p in everyone}
    for p in order:
        if p != me:
            b.copy(*gather[p])


def _twoshot_pipelined(
    b: Builder, tensor: torch.Tensor, op: ReduceOp, pieces: list[Region], part: Callable[[int, int], tuple[int, int]]
) -> None:
    """Two-shot, one sync a piece (module docstring)."""
    everyone = b.peers()
    P, me, k = b.world_size, b.rank, len(pieces)
    for t in range(k + 2):
        into, out = b.write_offset(), b.read_offset()
        if 1 <= t <= k:  # fold piece t - 1, my slice, my own from my tensor and the result back there
            lo, n = part(t - 1, me)
            mine = pieces[t - 1].sub(lo, n)
            srcs = [mine if p == me else b.slot(p, out + lo, n) for p in everyone]
            b.reduce(b.slot(me, into + lo, n), srcs, tensor.dtype, op, P, also=mine)
        rests = []
        for p in b.spread():
            copy_in = None
            if t < k and p != me:  # piece t's slice p, for rank p to fold next round
                lo, n = part(t, p)
                copy_in = (b.slot(me, into + lo, n), pieces[t].sub(lo, n))
            if t >= 2 and p != me:  # piece t - 2's slice p, folded by rank p last round (mine: by the fold)
                lo, n = part(t - 2, p)
                gather = (pieces[t - 2].sub(lo, n), b.slot(p, out + lo, n))
                if copy_in is None:
                    b.copy(*gather)
                else:
                    rests += _copy_paired(b, *gather, *copy_in)
            elif copy_in is not None:
                b.copy(*copy_in)
        for dst, src in rests:
            b.copy(dst, src)
        if t <= k:
            b.sync(everyone, everyone)


def _copy_paired(b: Builder, out: Region, theirs: object, dst: object, src: Region) -> list[tuple]:
    """``out = theirs`` and ``dst = src`` (one slice of the all-gather, one of the next copy-in, at
    one in-half position), paired over their common length; returns the longer one's rest, as
    (dst, src) pairs for the caller to copy."""
    common = min(out.nbytes, dst.nbytes)
    if common:
        b.copy_pair(out.sub(0, common), theirs.sub(0, common), dst.sub(0, common), src.sub(0, common))
    return [
        (out.sub(common, out.nbytes - common), theirs.sub(common, theirs.nbytes - common)),
        (dst.sub(common, dst.nbytes - common), src.sub(common, src.nbytes - common)),
    ]


def twoshot_symmetric(b: Builder, tensor: torch.Tensor, op: ReduceOp) -> None:
    """Two-shot in place on a tensor of the symmetric heap (module docstring)."""
    size = tensor.element_size()
    whole = Region.of(tensor)
    everyone = b.peers()
    P, me = b.world_size, b.rank
    unit = max(1, 16 // size)  # elements of one 16-byte vector
    units = -(-tensor.numel() // unit)
    bounds = [min(tensor.numel(), units * p // P * unit) * size for p in range(P + 1)]
    # Every instruction is a slice of about 1/P of the tensor at in-instruction position 0, so
    # that all channels share each one (channel c takes the same granules of slice p on rank p,
    # where it is reduced, and on every other rank, where it is read): the grid is sized for the
    # whole tensor, the granules for a slice.
    b.program.grid_bytes = whole.nbytes
    # Every rank's input was written by its earlier kernels: fenced (docs/kernel-contract.md).
    b.barrier_all(fence=True)
    lo, hi = bounds[me], bounds[me + 1]
    mine = whole.sub(lo, hi - lo)
    b.reduce(mine, [b.symmetric(p, mine) for p in everyone], tensor.dtype, op, P)
    b.sync(everyone, everyone)
    for p in b.spread():
        if p != me:
            theirs = whole.sub(bounds[p], bounds[p + 1] - bounds[p])
            b.copy(theirs, b.symmetric(p, theirs))
    # Nothing new to read: signal "done reading you" to every rank read above, wait for theirs.
    b.sync()


def ring(b: Builder, tensor: torch.Tensor, op: ReduceOp) -> None:
    P, q = b.world_size, b.rank
    if P == 1:
        oneshot(b, tensor, op)
        return
    size = tensor.element_size()
    whole = Region.of(tensor)
    prev, nxt = (q - 1) % P, (q + 1) % P

    def step() -> None:
        b.sync([prev], [nxt])

    for start, count in ranges(tensor.numel(), P * (b.half_bytes // size)):
        bounds = [(start + count * i // P) * size for i in range(P + 1)]
        chunk = [whole.sub(bounds[i], bounds[i + 1] - bounds[i]) for i in range(P)]
        # reduce-scatter
        first = chunk[(q - 1) % P]
        b.copy(b.slot(q, b.write_offset(), first.nbytes), first)
        step()
        for t in range(1, P):
            c = (q - 1 - t) % P
            last = t == P - 1
            partial = b.slot(prev, b.read_offset(), chunk[c].nbytes)
            out = b.slot(q, b.write_offset(), chunk[c].nbytes)
            b.reduce(out, [partial, chunk[c]], tensor.dtype, op if last else partial_op(op), P)
            if last:
                b.copy(chunk[c], out)
            step()
        # all-gather
        for t in range(1, P):
            c = (q - t) % P
            received = b.slot(prev, b.read_offset(), chunk[c].nbytes)
            if t == P - 1:
                b.copy(chunk[c], received)
            else:
                forward = b.slot(q, b.write_offset(), chunk[c].nbytes)
                b.copy(forward, received)
                b.copy(chunk[c], forward)
                step()


def tree_all_reduce(b: Builder, tensor: torch.Tensor, op: ReduceOp) -> None:
    whole = Region.of(tensor)
    tree.reduce_up(b, whole, whole, tensor.dtype, op, root=0)
    tree.broadcast_down(b, whole, root=0, unit=tensor.element_size())
