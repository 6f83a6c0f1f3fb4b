"""Collectives in place on symmetric tensors (gpucomm.empty): the peers' copies read where they are.

A tensor of the symmetric heap lies at the same offset of every rank's heap, and every rank maps
every heap (``Builder.symmetric(peer, region)`` names rank p's copy). So a collective reads the
peers' inputs in place: no copy into the workspace's halves, no pieces, and the result is written
straight where it goes. Each program is:

- a first sync (a full barrier, as every program's first is): every rank's input is in place.
  It is fenced (``fence=True``): the inputs were written by the ranks' earlier kernels, not by
  this program, so a system-scope fence goes before the release (docs/kernel-contract.md);
- the moves: every rank reads what it needs from the peers' copies and writes only its own
  memory (never a region another rank reads in this call);
- a last sync that carries "done reading you" to every rank read and waits for the ranks that
  read this one: after it the caller may write its tensors again.

Two syncs per call whatever the size (two-shot all_reduce, which reads results another rank
wrote in the call, has three: :func:`gpucomm.algorithms.allreduce.twoshot_symmetric`). Every
instruction is cut at in-instruction position 0 and the grid is sized for the bytes moved
(``Program.grid_bytes``), so every channel shares every instruction.

- broadcast: the others copy the root's tensor;
- reduce: the root folds every rank's tensor, in rank order, into its own;
- all_gather_into_tensor (symmetric input): every rank copies rank p's input into slice p of
  its output;
- reduce_scatter_tensor (symmetric input): rank r folds chunk r of every rank's input, in rank
  order, into its output.

Folds are the kernel contract's ``reduce`` over the P ranks in rank order, rounded once: the bits
of the direct algorithms on the halves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp

if TYPE_CHECKING:
    from gpucomm.ops.program import Builder

__all__ = ["broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]


def broadcast(b: Builder, tensor: torch.Tensor, root: int) -> None:
    whole = Region.of(tensor)
    b.program.grid_bytes = whole.nbytes
    me, everyone = b.rank, b.peers()
    others = [p for p in everyone if p != root]
    b.sync(sources=[] if me == root else [root], readers=others if me == root else [], fence=True)
    if me != root:
        b.copy(whole, b.symmetric(root, whole))
    b.sync()


def reduce(b: Builder, tensor: torch.Tensor, root: int, op: ReduceOp) -> None:
    whole = Region.of(tensor)
    b.program.grid_bytes = whole.nbytes
    me, everyone = b.rank, b.peers()
    b.sync(sources=everyone if me == root else [], readers=[] if me == root else [root], fence=True)
    if me == root:
        b.reduce(whole, [b.symmetric(p, whole) for p in everyone], tensor.dtype, op, b.world_size)
    b.sync()


def all_gather_into_tensor(b: Builder, output: Region, tensor: torch.Tensor) -> None:
    mine = Region.of(tensor)
    size = mine.nbytes
    b.program.grid_bytes = output.nbytes
    everyone = b.peers()
    b.sync(everyone, everyone, fence=True)
    for p in b.spread():
        slot = output.sub(p * size, size)
        if not (p == b.rank and slot.addr == mine.addr):  # in place: my slice holds my input already
            b.copy(slot, b.symmetric(p, mine))
    b.sync()


def reduce_scatter_tensor(b: Builder, output: Region, source: Region, dtype: torch.dtype, op: ReduceOp) -> None:
    size = output.nbytes
    b.program.grid_bytes = source.nbytes
    me, everyone = b.rank, b.peers()
    b.sync(everyone, everyone, fence=True)
    chunk = source.sub(me * size, size)
    b.reduce(output, [b.symmetric(p, chunk) for p in everyone], dtype, op, b.world_size)
    b.sync()
