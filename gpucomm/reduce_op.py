"""``ReduceOp``: the reduction operators of every reducing collective."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

__all__ = ["ReduceOp", "as_reduce_op"]


class ReduceOp(enum.IntEnum):
    """Reduction operators, named as in ``torch.distributed.ReduceOp``.

    ``AVG`` divides the sum by the number of ranks once, at the end, in the accumulation type
    (fp32 for 16-bit floats); on integer tensors it truncates towards zero.
    """

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    AVG = 4


_FROM_TORCH = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
    dist.ReduceOp.AVG: ReduceOp.AVG,
}


def as_reduce_op(op: object, fn: str) -> ReduceOp:
    """Accept a gpucomm or torch.distributed ReduceOp; anything else is a ``TypeError`` naming ``fn``."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)) and op in _FROM_TORCH:
        return _FROM_TORCH[op]
    raise TypeError(
        f"gpucomm.{fn}: op must be a gpucomm.ReduceOp (SUM, PRODUCT, MIN, MAX, AVG) or the "
        f"torch.distributed.ReduceOp of the same name, got {op!r} ({type(op).__name__})"
    )


# Reference semantics shared by the fallback and the torch kernels.
def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """16-bit floats accumulate in fp32 and round once; every other dtype in itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
