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
    from gpucomm.engine import Engine

__all__ = ["run", "direct", "ring"]


def run(algo: str, engine: Engine, chunks: Sequence[Region], out: Region, dtype: torch.dtype, op: ReduceOp, source: Region | None = None) -> None:
    """``source``: the contiguous input that ``chunks`` tile in order, if there is one."""
    if algo == "ring":
        ring(engine, chunks, out, dtype, op)
    else:
        direct(engine, chunks, out, dtype, op, source)


def direct(engine: Engine, chunks: Sequence[Region], out: Region, dtype: torch.dtype, op: ReduceOp, source: Region | None = None) -> None:
    me, P, k = engine.rank, engine.world_size, engine.kernels
    size = itemsize(dtype)
    cap = engine.half_bytes // P // size  # elements of each chunk per piece
    for t in range(count([c.nbytes // size for c in chunks], cap)):
        parts = [piece(c, t, cap, size) for c in chunks]
        offsets = [0]
        for part in parts:
            offsets.append(offsets[-1] + part.nbytes)
        base = engine.write_offset()
        if source is not None and all(p.nbytes == c.nbytes for p, c in zip(parts, chunks)):
            k.copy(engine.slot(me, base, source.nbytes), source)  # one piece: stage in one copy
        else:
            for i, part in enumerate(parts):
                k.copy(engine.slot(me, base + offsets[i], part.nbytes), part)
        everyone = engine.peers()
        engine.sync(everyone, everyone)
        nbytes = parts[me].nbytes
        srcs = [engine.slot(p, base + offsets[me], nbytes) for p in everyone]
        k.reduce(piece(out, t, cap, size), srcs, dtype, op, P)


def ring(engine: Engine, chunks: Sequence[Region], out: Region, dtype: torch.dtype, op: ReduceOp) -> None:
    P, q, k = engine.world_size, engine.rank, engine.kernels
    if P == 1:
        direct(engine, chunks, out, dtype, op)
        return
    prev, nxt = (q - 1) % P, (q + 1) % P
    size = itemsize(dtype)
    cap = engine.half_bytes // size
    for t in range(count([c.nbytes // size for c in chunks], cap)):
        parts = [piece(c, t, cap, size) for c in chunks]
        first = parts[(q - 1) % P]
        k.copy(engine.slot(q, engine.write_offset(), first.nbytes), first)
        engine.sync([prev], [nxt])
        for s in range(1, P):
            c = (q - 1 - s) % P
            partial = engine.slot(prev, engine.read_offset(), parts[c].nbytes)
            if s == P - 1:
                k.reduce(piece(out, t, cap, size), [partial, parts[c]], dtype, op, P)
            else:
                k.reduce(engine.slot(q, engine.write_offset(), parts[c].nbytes), [partial, parts[c]], dtype, partial_op(op), P)
                engine.sync([prev], [nxt])
