"""reduce_scatter (list and tensor forms) on the workspace: direct and ring.

``chunks[i]`` is this rank's contribution to rank i's result; ``out`` (the size of
``chunks[me]``, possibly the same memory) receives the reduction over ranks of everyone's
``chunks[me]``. Chunk sizes may differ from rank to rank of the *result* (the hierarchical
all-reduce cuts n elements into P shards), but every rank passes the same sizes.

direct (per piece of a P-th of a half per chunk): copy every chunk's piece into my half, packed
in chunk order (one copy when the chunks tile one contiguous ``source``); sync with all; rank
r reduces the P pieces of chunk r, in rank order, into ``out``: one rounding, one sync per
piece, (P-1)/P·n bytes read per rank.

ring (per piece of one half per chunk): step 0 copies my piece of chunk q-1 into my half; step
t = 1..P-1 is one fused launch ``half[q] = reduce(half[q-1], mine[q-1-t])`` (the last one
writes ``out`` and applies AVG's division); every step syncs with the neighbours only. P-1
syncs per piece; the fold of chunk c starts at rank c+1 and goes round the ring; 16-bit
partials are rounded at every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpucomm.algorithms._pieces import count, itemsize, partial_op, piece
from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp

if TYPE_CHECKING:
    from gpucomm.ops.program import Builder

__all__ = ["run", "direct", "ring"]


def run(
    algo: str,
    b: Builder,
    chunks: Sequence[Region],
    out: Region,
    dtype: torch.dtype,
    op: ReduceOp,
    source: Region | None = None,
) -> None:
    """``source``: the contiguous input that ``chunks`` tile in order, if there is one."""
    if algo == "ring":
        ring(b, chunks, out, dtype, op)
    else:
        direct(b, chunks, out, dtype, op, source)


def direct(
    b: Builder, chunks: Sequence[Region], out: Region, dtype: torch.dtype, op: ReduceOp, source: Region | None = None
) -> None:
    me, P = b.rank, b.world_size
    size = itemsize(dtype)
    cap = b.half_bytes // P // size  # elements of each chunk per piece
    for t in range(count([c.nbytes // size for c in chunks], cap)):
        parts = [piece(c, t, cap, size) for c in chunks]
        offsets = [0]
        for part in parts:
            offsets.append(offsets[-1] + part.nbytes)
        base = b.write_offset()
        if source is not None and all(p.nbytes == c.nbytes for p, c in zip(parts, chunks)):
            b.copy(b.slot(me, base, source.nbytes), source)  # one piece: stage in one copy
        else:
            for i, part in enumerate(parts):
                b.copy(b.slot(me, base + offsets[i], part.nbytes), part)
        everyone = b.peers()
        b.sync(everyone, everyone)
        nbytes = parts[me].nbytes
        srcs = [b.slot(p, base + offsets[me], nbytes) for p in everyone]
        b.reduce(piece(out, t, cap, size), srcs, dtype, op, P)


def ring(b: Builder, chunks: Sequence[Region], out: Region, dtype: torch.dtype, op: ReduceOp) -> None:
    P, q = b.world_size, b.rank
    if P == 1:
        direct(b, chunks, out, dtype, op)
        return
    prev, nxt = (q - 1) % P, (q + 1) % P
    size = itemsize(dtype)
    cap = b.half_bytes // size
    for t in range(count([c.nbytes // size for c in chunks], cap)):
        parts = [piece(c, t, cap, size) for c in chunks]
        first = parts[(q - 1) % P]
        b.copy(b.slot(q, b.write_offset(), first.nbytes), first)
        b.sync([prev], [nxt])
        for s in range(1, P):
            c = (q - 1 - s) % P
            partial = b.slot(prev, b.read_offset(), parts[c].nbytes)
            if s == P - 1:
                b.reduce(piece(out, t, cap, size), [partial, parts[c]], dtype, op, P)
            else:
                b.reduce(b.slot(q, b.write_offset(), parts[c].nbytes), [partial, parts[c]], dtype, partial_op(op), P)
                b.sync([prev], [nxt])
