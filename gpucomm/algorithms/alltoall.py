"""all_to_all and all_to_all_single on the workspace: direct, over byte regions.

``ins[j]`` goes to rank j, ``outs[j]`` comes from rank j; sizes may differ for every pair, and
no rank knows the sizes of pairs it is not part of. Yet every rank must make the same number of
syncs. So each half starts with a header of 2P int64 (what I send to each rank, what I expect
from each rank), written in the first round with the first pieces: after the first sync every
rank reads every header, knows the whole size matrix, checks that each pair agrees (a rank that
expects a different size than its peer sends makes every rank raise
:class:`CommMismatchError`), and runs max over pairs of ceil(bytes / sub-slot) rounds in all.

Round layout of a half: [header | sub-slot 0 | ... | sub-slot P-1]; sub-slot j holds this
round's piece for rank j. Each round is one sync with every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpucomm.algorithms._pieces import count, piece
from gpucomm.errors import CommMismatchError, UnsupportedError
from gpucomm.ops.contract import Region

if TYPE_CHECKING:
    from gpucomm.engine import Engine

__all__ = ["run"]

_ALIGN = 256


def _read_header(engine: Engine, peer: int, offset: int, P: int) -> list[int]:
    # Tiny metadata, read after the sync's acquire: a torch view is enough (no kernel launch).
    return engine.slot(peer, offset, 16 * P).view(torch.int64).tolist()


def run(engine: Engine, outs: Sequence[Region], ins: Sequence[Region]) -> None:
    me, P, k = engine.rank, engine.world_size, engine.kernels
    everyone = engine.peers()
    header = -(-16 * P // _ALIGN) * _ALIGN
    sub = (engine.half_bytes - header) // P // _ALIGN * _ALIGN or (engine.half_bytes - header) // P // 16 * 16
    if sub <= 0:
        raise UnsupportedError(f"gpucomm.{engine.op_name}: the workspace half ({engine.half_bytes} bytes) is too small for {P} ranks")
    base = engine.write_offset()
    sizes = torch.tensor([r.nbytes for r in ins] + [r.nbytes for r in outs], dtype=torch.int64)
    engine.slot(me, base, 16 * P).view(torch.int64).copy_(sizes.to(engine.device))
    rounds, t = 1, 0
    while t < rounds:
        offset = engine.write_offset() + header
        for j in everyone:
            if j != me:
                part = piece(ins[j], t, sub)
                k.copy(engine.slot(me, offset + j * sub, part.nbytes), part)
        engine.sync(everyone, everyone)
        if t == 0:
            matrix = [_read_header(engine, p, base, P) for p in everyone]
            _check(engine, matrix)
            rounds = count([size for row in matrix for size in row[:P]], sub)
            k.copy(outs[me], ins[me])
        for j in everyone:
            if j != me:
                part = piece(outs[j], t, sub)
                k.copy(part, engine.slot(j, offset + me * sub, part.nbytes))
        t += 1


def _check(engine: Engine, matrix: list[list[int]]) -> None:
    """Every rank checks every pair, so that all raise together."""
    P = engine.world_size
    for sender in range(P):
        for receiver in range(P):
            sent, expected = matrix[sender][receiver], matrix[receiver][P + sender]
            if sent != expected:
                raise CommMismatchError(
                    f"gpucomm.{engine.op_name}: rank {engine.members[sender]} sends {sent} bytes to rank "
                    f"{engine.members[receiver]}, which expects {expected}"
                )
