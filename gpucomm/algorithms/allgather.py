"""all_gather (list and tensor forms) on the workspace: direct and ring, over byte regions.

``outs[i]`` receives rank i's ``mine``; the sizes of ``outs`` may differ between ranks' slots
(the hierarchical all-reduce gathers shards of unequal size) but every rank passes the same
sizes, so every rank cuts the same pieces.

direct (per piece of one half): copy my piece into my half; sync with all; copy every peer's
piece out of its half. One sync per piece; each rank reads (P-1)·n bytes.

ring (per piece): step 0 copies my piece into my half; step t = 1..P-1 reads the piece of rank
q-t from q-1's half, copies it into its half (for q+1) and into ``outs[q-t]``. Every step
syncs with the neighbours only (``sources=[q-1]``, ``readers=[q+1]``): P-1 syncs per piece,
(P-1)·n bytes read per rank, each from one neighbour. The write-safety argument is the ring
all-reduce's (gpucomm.algorithms.allreduce).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gpucomm.algorithms._pieces import count, piece
from gpucomm.ops.contract import Region

if TYPE_CHECKING:
    from gpucomm.ops.program import Builder

__all__ = ["run", "direct", "ring"]


def run(algo: str, b: Builder, mine: Region, outs: Sequence[Region]) -> None:
    {"direct": direct, "ring": ring}[algo](b, mine, outs)


def _own(b: Builder, mine: Region, outs: Sequence[Region]) -> None:
    """My own input into my slot of the output, last.

    Ranks whose calls differ raise at a sync, and so before anything is written into the caller's
    tensors.
    """
    own = outs[b.rank]
    if own.addr != mine.addr:
        b.copy(own, mine)


def direct(b: Builder, mine: Region, outs: Sequence[Region]) -> None:
    me = b.rank
    everyone = b.peers()
    cap = b.half_bytes
    for t in range(count([o.nbytes for o in outs], cap)):
        offset = b.write_offset()
        mine_t = piece(mine, t, cap)
        b.copy(b.slot(me, offset, mine_t.nbytes), mine_t)
        b.sync(everyone, everyone)
        for p in b.spread():
            if p != me:
                out_t = piece(outs[p], t, cap)
                b.copy(out_t, b.slot(p, offset, out_t.nbytes))
    _own(b, mine, outs)


def ring(b: Builder, mine: Region, outs: Sequence[Region]) -> None:
    P, q = b.world_size, b.rank
    if P == 1:
        direct(b, mine, outs)
        return
    prev, nxt = (q - 1) % P, (q + 1) % P
    cap = b.half_bytes
    for t in range(count([o.nbytes for o in outs], cap)):
        mine_t = piece(mine, t, cap)
        b.copy(b.slot(q, b.write_offset(), mine_t.nbytes), mine_t)
        b.sync([prev], [nxt])
        for s in range(1, P):
            out_t = piece(outs[(q - s) % P], t, cap)
            received = b.slot(prev, b.read_offset(), out_t.nbytes)
            if s == P - 1:
                b.copy(out_t, received)
            else:
                forward = b.slot(q, b.write_offset(), out_t.nbytes)
                b.copy(forward, received)
                b.copy(out_t, forward)
                b.sync([prev], [nxt])
    _own(b, mine, outs)
