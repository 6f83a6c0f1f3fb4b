"""all_reduce on the workspace: one-shot, two-shot, ring and tree.

Rounds, halves and the ``sync(sources, readers)`` contract are those of gpucomm.ops.program:
data written between two syncs is read by its readers after the next one, and only then.

one-shot (per piece of up to one half): copy my piece into my half; sync with all; every rank
reduces all P halves, in rank order, straight into its own tensor. One sync per piece.

two-shot (per piece of up to one half): copy in the P - 1 slices the peers fold; sync with all;
rank r reduces slice r of every rank's half (its own straight from its tensor) into slice r of
its *other* half and into its tensor (one REDUCE storing twice: no copy of its own slice out of the
half); sync with all; every rank copies slice p from rank p (all-gather). Two syncs; a message of up to
one half (one piece) runs so. Every per-peer loop starts at the rank's own next peer.

two-shot pipelined (more than one piece): one sync per piece. Round t reduces piece
t - 1 (staged in round t - 1) carrying piece t's copy-in (Builder.reduce's ``carry``: the kernels
run it inside the fold's loop, its loads beside the fold's link reads), then gathers piece t - 2
(reduced in round t - 1). Both kinds of data share a half: in the half of round t, rank r's slice r
holds its fold of piece t - 1, its other slices piece t's copy-in; no position is written twice in a
round, and every rank reads the peers' half of the last round only. Pieces + 1 syncs. The first
piece's copy-in is the one nothing carries, so the first piece is short (1/FIRST_PIECE_SHARE of a
half), its slices 1/P of it at the in-half positions of a full piece's, and the program's granules
are sized by it so that every channel shares it (Program.granule_extent).

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

Out of place (gpucomm.all_reduce_into): one-shot, two-shot (both schedules) and ring take the
caller's ``output`` beside ``tensor``. Every read of the caller's data (copy-in, a rank's own slice
in the fold, a ring step's fused fold) reads ``tensor``; every store of a result (one-shot's fold, the
two-shot fold's second destination, the all-gathers) writes ``output``. Same instructions, same
bytes moved, same syncs: no pass of its own, and nothing is ever read back from ``output``.

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

__all__ = ["OUT_OF_PLACE", "run", "oneshot", "twoshot", "twoshot_symmetric", "ring", "tree_all_reduce"]


# The forms with an out-of-place program (gpucomm.workspace.collectives.EngineCollectives.all_reduce_into):
# they read ``tensor`` and write ``output`` with the passes of the in-place form, no more.
OUT_OF_PLACE = ("oneshot", "twoshot", "ring")


def run(algo: str, b: Builder, tensor: torch.Tensor, op: ReduceOp, output: torch.Tensor | None = None) -> None:
    """All-reduce ``tensor`` with ``algo``: in place, or into ``output`` (an algorithm of
    OUT_OF_PLACE; ``tensor`` is then only read, and ``output`` the call's other buffer)."""
    forms = {"oneshot": oneshot, "twoshot": twoshot, "ring": ring, "tree": tree_all_reduce}
    if output is None:
        forms[algo](b, tensor, op)
    else:
        forms[algo](b, tensor, op, output)


def _dest(tensor: torch.Tensor, output: torch.Tensor | None) -> tuple[Region, Region]:
    """The regions of the input and of the result (the same one in place)."""
    whole = Region.of(tensor)
    return whole, whole if output is None else Region.of(output)


def _at(region: Region, whole: Region, dest: Region) -> Region:
    """The part of ``dest`` at ``region``'s place in ``whole``."""
    return region if dest is whole else dest.sub(region.addr - whole.addr, region.nbytes)


def oneshot(b: Builder, tensor: torch.Tensor, op: ReduceOp, output: torch.Tensor | None = None) -> None:
    size = tensor.element_size()
    whole, dest = _dest(tensor, output)
    everyone = b.peers()
    for start, count in ranges(tensor.numel(), b.half_bytes // size):
        mine = whole.sub(start * size, count * size)
        offset = b.write_offset()
        b.copy(b.slot(b.rank, offset, mine.nbytes), mine)
        b.sync(everyone, everyone)
        slots = [b.slot(p, offset, mine.nbytes) for p in everyone]
        b.reduce(_at(mine, whole, dest), slots, tensor.dtype, op, b.world_size)


# Two-shot runs pipelined from two pieces on (twoshot), by the model (both ends charged, 8 ranks,
# 0.82 x 450 GB/s, 24 MiB halves, the fold storing into my tensor too and carrying the next copy-in;
# python -m gpucomm._bench.model), device us two syncs a piece / pipelined: 25 MiB 147.0 / 140.0,
# 32 MiB 183.9 / 177.8, 64 MiB 352.3 / 339.9, 128 MiB 688.6 / 667.4, 1 GiB 5367.8 / 5236.2; at
# 0.57 x 450 GB/s ahead at every one too (25 MiB 201.5 / 194.5, 64 MiB 491.9 / 479.5). So the
# two-syncs-a-piece form is gone; one piece (up to a half) keeps two syncs: with nothing to carry,
# the pipelined program would be the same.
# The pipelined form's first piece: 1/FIRST_PIECE_SHARE of a half. Its copy-in is the one nothing
# carries (round 0 has no fold), so a short one exposes less; each piece more costs a SYNC. The model
# at 0.82 x 450 GB/s, first piece 1/2, 1/3, 1/4, 1/6, 1/8 of a half: 64 MiB 343.6, 341.2, 339.9,
# 342.7, 344.4 us; 48 MiB 261.0, 258.6, 257.9, 261.4, 263.1; 1 GiB 5237.7, 5235.2, 5236.2, 5239.1,
# 5240.5; at 0.57 x 450, 64 MiB 483.2, 480.8, 479.5, 478.3, 480.7. From two halves on the rest's
# pieces are each over half a half, so the first is the shortest.
FIRST_PIECE_SHARE = 4


def _two_shot_pieces(
    b: Builder, tensor: torch.Tensor, first: int = 0
) -> tuple[list[Region], Callable[[int, int], tuple[int, int, int]]]:
    """The pieces of a two-shot, and where slice p of piece t lies: (offset in the piece, bytes,
    in-half position).

    ``first`` (elements, 0: none): a short piece first, then the even pieces of
    gpucomm.algorithms._pieces for the rest; without it, those even pieces with the short one first.
    Slice p sits at one in-half position in every piece, that of a full piece's slice p: the
    slices of a full piece (and of one a few elements short) are cut at a full piece's bounds,
    clipped to its length, so its P - 1 slices other than a rank's own are two contiguous ranges,
    before it and after it (what a REDUCE carries); those of the short first piece are 1/P of it
    each, so that every rank folds its share of it, at their own slice's position (a gap after each).
    """
    size, P = tensor.element_size(), b.world_size
    cap = b.half_bytes // size
    if first:
        counts = [first] + [count for _, count in ranges(tensor.numel() - first, cap)]
    else:
        counts = [count for _, count in ranges(tensor.numel(), cap)][::-1]
    whole, full = Region.of(tensor), max(counts)
    pieces = [whole.sub(sum(counts[:k]) * size, count * size) for k, count in enumerate(counts)]
    short = bool(first) and len(counts) > 1
    if short:
        # Granules sized by the short piece (device_executor.channel_layout): its 1/P slices span the
        # grid, so every channel gets its share of them, not a quarter of the channels all of it.
        b.program.granule_extent = counts[0] * size

    def part(t: int, p: int) -> tuple[int, int, int]:
        if t == 0 and short:
            lo, hi = (counts[0] * q // P * size for q in (p, p + 1))
            return lo, hi - lo, full * p // P * size
        lo, hi = (min(counts[t], full * q // P) * size for q in (p, p + 1))
        hi = counts[t] * size if p == P - 1 else hi
        return lo, hi - lo, lo

    return pieces, part


def twoshot(b: Builder, tensor: torch.Tensor, op: ReduceOp, output: torch.Tensor | None = None) -> None:
    """Two-shot (module docstring); into ``output``: copy-in and my own slice's fold read ``tensor``,
    the fold's second store and the all-gather write ``output``."""
    size = tensor.element_size()
    whole, dest = _dest(tensor, output)
    if tensor.numel() * size > b.half_bytes:  # more than one piece: pipelined (the rows above)
        unit = max(1, 16 // size)  # the short first piece ends on a 16-byte boundary
        first = max(unit, b.half_bytes // FIRST_PIECE_SHARE // size // unit * unit)
        pieces, part = _two_shot_pieces(b, tensor, first if tensor.numel() > first else 0)
        _twoshot_pipelined(b, tensor, op, pieces, part, [_at(r, whole, dest) for r in pieces])
        return
    # One piece: nothing to carry, two syncs.
    (mine,), part = _two_shot_pieces(b, tensor)
    everyone = b.peers()
    P, me = b.world_size, b.rank
    # Per-peer loops start at my own rank (Builder.spread): in step i rank r reads rank r + i's slice,
    # so each GPU's outbound link serves one reader a step. The reduce keeps rank order.
    order = b.spread()
    result = _at(mine, whole, dest)  # where the result goes (mine itself, in place)
    staged = b.write_offset()
    # My own slice is read by me alone (rank r folds slice r): the fold takes it from my tensor and
    # stores its result there as well as into my half, so only the other P - 1 slices are copied in
    # and my own is never copied out (a local copy alone in its step: 1.9 us a 21 MiB piece, 8 ranks,
    # by the model).
    for p in order:
        if p != me:
            lo, n, _ = part(0, p)
            b.copy(b.slot(me, staged + lo, n), mine.sub(lo, n))
    b.sync(everyone, everyone)
    lo, n, _ = part(0, me)
    reduced = b.write_offset()
    slices = [mine.sub(lo, n) if p == me else b.slot(p, staged + lo, n) for p in everyone]
    b.reduce(b.slot(me, reduced + lo, n), slices, tensor.dtype, op, P, also=result.sub(lo, n))
    b.sync(everyone, everyone)
    for p in order:
        if p != me:
            lo, n, _ = part(0, p)
            b.copy(result.sub(lo, n), b.slot(p, reduced + lo, n))


def _twoshot_pipelined(
    b: Builder,
    tensor: torch.Tensor,
    op: ReduceOp,
    pieces: list[Region],
    part: Callable[[int, int], tuple[int, int, int]],
    results: list[Region],
) -> None:
    """Two-shot, one sync a piece (module docstring): round t folds piece t - 1 carrying piece t's
    copy-in (Builder.reduce's ``carry``: the copy's loads in flight beside the fold's link reads),
    then gathers piece t - 2. ``results``: where each piece's result goes (the pieces, in place)."""
    everyone = b.peers()
    P, me, k = b.world_size, b.rank, len(pieces)
    for t in range(k + 2):
        into, out = b.write_offset(), b.read_offset()
        copy_in = []  # piece t's slices but mine, for their ranks to fold next round
        if t < k:
            slices = [part(t, p) for p in range(P)]
            if 1 <= t:  # a full piece (or one a few elements short): the slices before mine, those after
                spans = [(slices[0][0], slices[me][0]), (slices[me][0] + slices[me][1], pieces[t].nbytes)]
                copy_in = [(b.slot(me, into + lo, hi - lo), pieces[t].sub(lo, hi - lo)) for lo, hi in spans if hi > lo]
            else:  # the first piece: nothing to carry it, slice by slice at their own positions
                for p in b.spread():
                    lo, n, pos = slices[p]
                    if p != me and n:
                        b.copy(b.slot(me, into + pos, n), pieces[t].sub(lo, n))
        if 1 <= t <= k:  # fold piece t - 1, my slice, my own from my tensor and the result back there
            lo, n, pos = part(t - 1, me)
            mine = pieces[t - 1].sub(lo, n)
            srcs = [mine if p == me else b.slot(p, out + pos, n) for p in everyone]
            if n:
                also = results[t - 1].sub(lo, n)
                b.reduce(b.slot(me, into + pos, n), srcs, tensor.dtype, op, P, also=also, carry=copy_in)
            else:  # an empty slice (a piece shorter than P elements): nothing to fold, nothing to carry
                for dst, src in copy_in:
                    b.copy(dst, src)
        if t >= 2:  # piece t - 2's slices, folded by their ranks last round (mine: by the fold)
            for p in b.spread():
                lo, n, pos = part(t - 2, p)
                if p != me and n:
                    b.copy(results[t - 2].sub(lo, n), b.slot(p, out + pos, n))
        if t <= k:
            b.sync(everyone, everyone)


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


def ring(b: Builder, tensor: torch.Tensor, op: ReduceOp, output: torch.Tensor | None = None) -> None:
    """Ring (module docstring); into ``output``: the first step and the fused folds read ``tensor``,
    the last fold's copy and the all-gather write ``output``."""
    P, q = b.world_size, b.rank
    if P == 1:
        oneshot(b, tensor, op, output)
        return
    size = tensor.element_size()
    whole, dest = _dest(tensor, output)
    prev, nxt = (q - 1) % P, (q + 1) % P

    def step() -> None:
        b.sync([prev], [nxt])

    for start, count in ranges(tensor.numel(), P * (b.half_bytes // size)):
        bounds = [(start + count * i // P) * size for i in range(P + 1)]
        chunk = [whole.sub(bounds[i], bounds[i + 1] - bounds[i]) for i in range(P)]
        done = [_at(c, whole, dest) for c in chunk]  # where each chunk's result goes
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
                b.copy(done[c], out)
            step()
        # all-gather
        for t in range(1, P):
            c = (q - t) % P
            received = b.slot(prev, b.read_offset(), chunk[c].nbytes)
            if t == P - 1:
                b.copy(done[c], received)
            else:
                forward = b.slot(q, b.write_offset(), chunk[c].nbytes)
                b.copy(forward, received)
                b.copy(done[c], forward)
                step()


def tree_all_reduce(b: Builder, tensor: torch.Tensor, op: ReduceOp) -> None:
    whole = Region.of(tensor)
    tree.reduce_up(b, whole, whole, tensor.dtype, op, root=0)
    tree.broadcast_down(b, whole, root=0, unit=tensor.element_size())
