"""all_reduce into another tensor on the workspace: an out-of-place program, or a copy and the in-place call.

One-shot, two-shot (both schedules) and ring through the halves have an out-of-place program
(:data:`gpucomm.algorithms.allreduce.OUT_OF_PLACE`): it reads the input where the in-place one reads
the tensor and stores where it stores, so it moves the bytes of an in-place call and no more. Every
other form copies the input into the output, then runs the in-place call on the output, in the same
stream order (the copy is queued where the call's launches go): the tree, the small path, multimem,
the in-place two-shot on a symmetric output, the gpucomm.language one-shot and the hierarchical form.
``GPUCOMM_DEBUG=DEBUG`` says which of the two a call took.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from gpucomm import log
from gpucomm.algorithms import allreduce
from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp
from gpucomm.work import Work

# The engine (gpucomm.workspace.engine.Engine) is typed Any: it imports this module through its
# collectives, and the import graph has no circles (tests/test_import_graph.py).
Engine = Any
Launch = Callable[[], None]

__all__ = ["all_reduce_into", "bind", "copy_then_in_place", "in_place_only"]

# Part of the program cache key (Engine.program's ``local``), not of the fingerprint: an out-of-place
# program and an in-place one of one shape never share a cache entry, yet ranks that mix the two
# forms in one call still agree (the same SYNCs, the same identity).
INTO = ("into",)


def in_place_only(engine: Engine, output: torch.Tensor, op: ReduceOp, algo: str) -> str | None:
    """Why ``algo`` has no out-of-place program for this call (None: it has one)."""
    if algo not in allreduce.OUT_OF_PLACE:
        return f"algo={algo} runs in place only"
    if algo == "twoshot" and engine._multimem_by_default(output, op, algo):
        return "multimem runs in place only"
    if algo == "twoshot" and "symmetric" in engine._all_reduce_plan(output, op, algo)[0]:
        return "the symmetric two-shot runs in place on the output"
    return None


def all_reduce_into(engine: Engine, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, algo: str) -> Work:
    """``output`` = the all_reduce of ``tensor`` with ``algo``; ``tensor`` is left as it is."""
    launch = bind(engine, output, tensor, op, algo)
    if launch is None:
        copy_then_in_place(engine.comm_rank, output, tensor, in_place_only(engine, output, op, algo))
        return engine.all_reduce(output, op, algo=algo)
    if log.logger.isEnabledFor(logging.DEBUG):
        log.logger.debug(f"gpucomm DEBUG [rank {engine.comm_rank}] all_reduce_into: out-of-place program, algo={algo}")
    launch()
    return engine.completed()


def bind(engine: Engine, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, algo: str) -> Launch | None:
    """The launch of the out-of-place program (as Engine.bind_all_reduce's: it holds the buffers'
    addresses, never the tensors; gpucomm.workspace.repeat keeps it), or None where ``algo`` has none."""
    if in_place_only(engine, output, op, algo) is not None:
        return None
    regions = [Region.of(tensor), Region.of(output)]
    fields = (tensor.dtype, tensor.numel(), op.name, algo)
    build = lambda b: allreduce.run(algo, b, tensor, op, output)  # noqa: E731
    program = engine.program("all_reduce", fields, regions, build, local=INTO)
    return engine.executor.bind(program, tuple(r.addr for r in regions))


def copy_then_in_place(rank: int, output: torch.Tensor, tensor: torch.Tensor, why: str) -> None:
    """``output.copy_(tensor)`` on the current stream (the caller's, or the one the call's launches
    go to), before the in-place call on ``output``; logged under GPUCOMM_DEBUG=DEBUG."""
    if log.logger.isEnabledFor(logging.DEBUG):
        log.logger.debug(f"gpucomm DEBUG [rank {rank}] all_reduce_into: output.copy_(input), then in place ({why})")
    output.copy_(tensor)
