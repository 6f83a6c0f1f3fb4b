"""all_to_all and all_to_all_single on the workspace: direct, over byte regions, in two programs.

``ins[j]`` goes to rank j, ``outs[j]`` comes from rank j; sizes may differ for every pair, and
no rank knows the sizes of pairs it is not part of. Yet every rank must make the same number of
syncs, and a program cannot depend on data it has not seen. So the collective runs as two
programs with one read of the workspace by the host in between:

1. :func:`announce`: each rank writes a header of 2P int64 (what it sends to each rank, what it
   expects from each rank) and its first piece for every peer into its half, then syncs with
   everyone;
2. the host reads every header (:func:`rounds`): it checks that each pair agrees (a rank that
   expects a different size than its peer sends makes every rank raise
   :class:`CommMismatchError`) and derives the number of rounds, max over pairs of
   ceil(bytes / sub-slot), the same on every rank;
3. :func:`deliver`: every rank copies the first pieces out, then runs the remaining rounds
   (copy in, sync with everyone, copy out).

Round layout of a half: [header | sub-slot 0 | ... | sub-slot P-1]; sub-slot j holds the
round's piece for rank j. The host read costs one wait for the device per call on a GPU: it is
the one collective whose schedule depends on what the peers pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpucomm.algorithms._pieces import count, piece
from gpucomm.errors import CommMismatchError, UnsupportedError
from gpucomm.ops.contract import Region

if TYPE_CHECKING:
    from gpucomm.ops.program import Builder

__all__ = ["announce", "rounds", "deliver", "header_bytes", "size_table"]

_ALIGN = 256


def header_bytes(world_size: int) -> int:
    return -(-16 * world_size // _ALIGN) * _ALIGN


def _sub_slot(half_bytes: int, world_size: int, op_name: str) -> int:
    room = half_bytes - header_bytes(world_size)
    sub = room // world_size // _ALIGN * _ALIGN or room // world_size // 16 * 16
    if sub <= 0:
        raise UnsupportedError(
            f"gpucomm.{op_name}: the workspace half ({half_bytes} bytes) is too small for {world_size} ranks"
        )
    return sub


def announce(b: Builder, outs: Sequence[Region], ins: Sequence[Region], sizes: Region) -> None:
    """Program 1: the header and the first pieces, then a sync with everyone.

    The header is ``sizes``: 2P int64, my sends then my receives.
    """
    me, P = b.rank, b.world_size
    sub = _sub_slot(b.half_bytes, P, b.op_name)
    base = b.write_offset()
    # Every rank's pieces differ in size: the whole round layout, the same on every rank.
    b.reserve(base, header_bytes(P) + P * sub)
    b.copy(b.slot(me, base, sizes.nbytes), sizes)
    offset = base + header_bytes(P)
    for j in b.peers():
        if j != me:
            part = piece(ins[j], 0, sub)
            b.copy(b.slot(me, offset + j * sub, part.nbytes), part)
    b.barrier_all()


def rounds(matrix: list[list[int]], half_bytes: int, members: Sequence[int], op_name: str) -> int:
    """The number of rounds, from the headers of every rank (``matrix[p]``: rank p's 2P sizes).

    Every rank checks every pair, so that all raise together.
    """
    P = len(matrix)
    for sender in range(P):
        for receiver in range(P):
            sent, expected = matrix[sender][receiver], matrix[receiver][P + sender]
            if sent != expected:
                raise CommMismatchError(
                    f"gpucomm.{op_name}: rank {members[sender]} sends {sent} bytes to rank "
                    f"{members[receiver]}, which expects {expected}"
                )
    sub = _sub_slot(half_bytes, P, op_name)
    return count([size for row in matrix for size in row[:P]], sub)


def deliver(b: Builder, outs: Sequence[Region], ins: Sequence[Region], total_rounds: int) -> None:
    """Program 2: copy the announced pieces out, then the remaining rounds."""
    me, P = b.rank, b.world_size
    sub = _sub_slot(b.half_bytes, P, b.op_name)
    for t in range(total_rounds):
        b.reserve(b.write_offset(), header_bytes(P) + P * sub)  # as announce: one layout on every rank
        if t > 0:
            offset = b.write_offset() + header_bytes(P)
            for j in b.peers():
                if j != me:
                    part = piece(ins[j], t, sub)
                    b.copy(b.slot(me, offset + j * sub, part.nbytes), part)
            b.barrier_all()
        offset = b.read_offset() + header_bytes(P)
        if t == 0:
            b.copy(outs[me], ins[me])
        for j in b.spread():
            if j != me:
                part = piece(outs[j], t, sub)
                b.copy(part, b.slot(j, offset + me * sub, part.nbytes))


def size_table(outs: Sequence[Region], ins: Sequence[Region], device: torch.device) -> torch.Tensor:
    """The header a rank announces: bytes it sends to each rank, then bytes it expects from each."""
    return torch.tensor([r.nbytes for r in ins] + [r.nbytes for r in outs], dtype=torch.int64).to(device)
