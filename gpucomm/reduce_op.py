"""``ReduceOp``: the reduction operators of every reducing collective."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

__all__ = ["ReduceOp", "PremulSum", "as_reduce_op", "premul_factor"]


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


class PremulSum:
    """``ReduceOp.PREMUL_SUM(factor)``: the SUM of every rank's tensor multiplied by ``factor``.

    torch.distributed builds the same operator with ``_make_nccl_premul_sum(factor)``. The
    multiplication happens in the tensor's dtype on a copy, as NCCL's premultiplied sum does; the
    caller's tensor is only written with the result.
    """

    def __init__(self, factor: float) -> None:
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise TypeError(f"gpucomm.ReduceOp.PREMUL_SUM: factor must be a Python number, got {type(factor).__name__}")
        self.factor = float(factor)

    def __repr__(self) -> str:
        return f"ReduceOp.PREMUL_SUM({self.factor:g})"


# Not an enum member: every kernel implements the five members, and PREMUL_SUM is a SUM of
# scaled copies, built by calling it with the factor.
ReduceOp.PREMUL_SUM = PremulSum  # type: ignore[attr-defined]


def premul_factor(op: object, fn: str) -> float | None:
    """The factor of a ``ReduceOp.PREMUL_SUM(factor)``; None for any other operator.

    Raises TypeError for ``ReduceOp.PREMUL_SUM`` given without its factor.
    """
    if op is PremulSum or (isinstance(op, dist.ReduceOp.RedOpType) and op == dist.ReduceOp.PREMUL_SUM):
        raise TypeError(f"gpucomm.{fn}: PREMUL_SUM needs its factor: pass op=gpucomm.ReduceOp.PREMUL_SUM(factor)")
    return op.factor if isinstance(op, PremulSum) else None


# Reference semantics shared by the fallback and the torch kernels.
def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """16-bit floats accumulate in fp32 and round once; every other dtype in itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
