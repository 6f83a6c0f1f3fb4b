"""all_reduce on the workspace: one-shot and two-shot.

one-shot (per piece): copy my piece into my slot; barrier with all; every rank reduces all P
slots, in rank order, straight into its own tensor. One barrier, (P-1)·n bytes read per rank.

two-shot (per piece): copy in; barrier; rank r reduces slice r of all P slots into slice r of
its own slot (reduce-scatter); barrier; every rank copies slice p from rank p's slot into its
tensor (all-gather). Two barriers, 2·(P-1)/P·n bytes read per rank.

Both fold the sources in rank order with one kernel per slice, so every rank ends with bitwise
the same bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp

if TYPE_CHECKING:
    from gpucomm.engine import Engine

__all__ = ["run"]


def run(algo: str, engine: Engine, tensor: torch.Tensor, op: ReduceOp) -> None:
    {"oneshot": oneshot, "twoshot": twoshot}[algo](engine, tensor, op)


def oneshot(engine: Engine, tensor: torch.Tensor, op: ReduceOp) -> None:
    size = tensor.element_size()
    whole = Region.of(tensor)
    everyone = engine.peers()
    for start, count in engine.pieces(tensor.numel(), size):
        mine = whole.sub(start * size, count * size)
        offset = engine.stage()
        engine.kernels.copy(engine.slot(engine.rank, offset, mine.nbytes), mine)
        engine.sync(everyone)
        slots = [engine.slot(p, offset, mine.nbytes) for p in everyone]
        engine.kernels.reduce(mine, slots, tensor.dtype, op, engine.world_size)


def twoshot(engine: Engine, tensor: torch.Tensor, op: ReduceOp) -> None:
    size = tensor.element_size()
    whole = Region.of(tensor)
    everyone = engine.peers()
    P = engine.world_size
    for start, count in engine.pieces(tensor.numel(), size):
        mine = whole.sub(start * size, count * size)
        offset = engine.stage()
        engine.kernels.copy(engine.slot(engine.rank, offset, mine.nbytes), mine)
        engine.sync(everyone)
        bounds = [count * p // P for p in range(P + 1)]
        lo, hi = bounds[engine.rank] * size, bounds[engine.rank + 1] * size
        slices = [engine.slot(p, offset + lo, hi - lo) for p in everyone]
        engine.kernels.reduce(slices[engine.rank], slices, tensor.dtype, op, P)
        engine.sync(everyone)
        for p in everyone:
            lo, hi = bounds[p] * size, bounds[p + 1] * size
            engine.kernels.copy(mine.sub(lo, hi - lo), engine.slot(p, offset + lo, hi - lo))
