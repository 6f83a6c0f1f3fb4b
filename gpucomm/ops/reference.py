"""``TorchKernels``: the kernel contract in plain torch ops, the oracle of every other implementation.

It works on the ``bytes`` views of :class:`Region` and reproduces the Triton kernels bit for bit:
the same left-to-right fold, the same accumulation type, one rounding at the end, the same
IEEE division for AVG. On CPU it is the kernels of the shared-memory path; its flags use real
release/acquire atomics (:mod:`gpucomm.ops.host_atomics`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from gpucomm.ops import host_atomics
from gpucomm.ops._validate import check_copy, check_epoch, check_flags, check_reduce
from gpucomm.ops.contract import FLAG_DTYPE, Region
from gpucomm.reduce_op import ReduceOp, accumulation_dtype

__all__ = ["TorchKernels", "fold_into", "needs_scratch"]

# Host polling backs off from busy spinning to short sleeps, so that a rank waiting on a slow
# peer does not starve it of a core (CI machines have two).
_SPIN_POLLS = 200
_MAX_SLEEP_S = 1e-3


_FOLD = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,  # then one division
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,  # NaN propagates, as in the other implementations
    ReduceOp.MAX: torch.maximum,
}


def needs_scratch(out: Region, srcs: Sequence[Region], dtype: torch.dtype) -> bool:
    """Whether :func:`fold_into` needs an accumulation buffer: 16-bit floats accumulate in fp32,
    and an ``out`` that is a later source must not be written before that source is read."""
    return accumulation_dtype(dtype) != dtype or any(s.addr == out.addr for s in srcs[1:])


def fold_into(
    out: torch.Tensor, srcs: Sequence[torch.Tensor], op: ReduceOp, divisor: int, acc: torch.Tensor | None
) -> None:
    """``out = op(srcs[0], srcs[1], ...)``, folded left to right in place, rounded once.

    ``out`` and ``srcs`` are views of the element type; ``acc`` (or ``out`` itself when None,
    see :func:`needs_scratch`) holds the running result in the accumulation type. In-place folds
    move each byte once per source, at memory speed, where a new tensor per step would not.
    """
    fold = _FOLD[op]
    target = out if acc is None else acc
    rest = srcs[1:]
    if acc is None and rest:
        # The first step straight into out: the same bits as a copy then a fold, one op fewer
        # (4 of the 12 us that fold_into took for an 8-byte gloo all_reduce at 2 ranks on the
        # 2-core VM). out may be srcs[0]; a later source gets an acc (needs_scratch).
        fold(srcs[0], rest[0], out=target)
        rest = rest[1:]
    elif target.data_ptr() != srcs[0].data_ptr():
        target.copy_(srcs[0])  # widening to fp32 is exact
    for src in rest:
        fold(target, src, out=target)  # mixed 16-bit sources are promoted to fp32 first
    if op is ReduceOp.AVG:
        _divide(target, divisor)
    if acc is not None:
        out.copy_(acc)  # the one rounding, to nearest even


def _divide(acc: torch.Tensor, divisor: int) -> None:
    if not acc.is_floating_point():
        torch.div(acc, divisor, rounding_mode="trunc", out=acc)
    elif acc.is_cuda:
        # A tensor divisor: CUDA torch turns division by a scalar into a multiplication by its
        # reciprocal, which is not the correctly rounded quotient.
        torch.div(acc, torch.full_like(acc, divisor), out=acc)
    else:
        acc.div_(divisor)  # CPU torch divides fp32 and fp64 by a scalar exactly


class TorchKernels:
    """The kernel contract (:class:`gpucomm.ops.Kernels`) in torch ops; CPU and CUDA regions.

    Example::

        >>> import torch
        >>> from gpucomm.ops import Region
        >>> from gpucomm.reduce_op import ReduceOp
        >>> a, b, out = torch.ones(3), torch.full((3,), 2.0), torch.empty(3)
        >>> TorchKernels().reduce(Region.of(out), [Region.of(a), Region.of(b)], torch.float32, ReduceOp.SUM)
        >>> out.tolist()
        [3.0, 3.0, 3.0]
    """

    name = "torch"

    def copy(self, dst: Region, src: Region) -> None:
        check_copy(dst, src)
        if dst.nbytes:
            dst.bytes.copy_(src.bytes)

    def reduce(
        self,
        out: Region,
        srcs: Sequence[Region],
        dtype: torch.dtype,
        op: ReduceOp,
        divisor: int = 1,
    ) -> None:
        op = check_reduce(out, srcs, dtype, op, divisor)
        if out.nbytes == 0:
            return
        target = out.view(dtype)
        acc = torch.empty_like(target, dtype=accumulation_dtype(dtype)) if needs_scratch(out, srcs, dtype) else None
        fold_into(target, [s.view(dtype) for s in srcs], op, divisor, acc)

    def signal(self, flags: Sequence[Region], epoch: int) -> None:
        check_flags("signal", flags)
        check_epoch("signal", epoch)
        for flag in flags:
            if flag.device.type == "cpu":
                host_atomics.store_release(flag.addr, epoch)
            else:
                # In stream order after this rank's earlier writes.
                flag.view(FLAG_DTYPE).fill_(epoch)

    def wait(self, flags: Sequence[Region], epoch: int, deadline: float) -> list[int]:
        check_flags("wait", flags)
        check_epoch("wait", epoch)
        if flags and flags[0].device.type == "cuda":
            torch.cuda.synchronize(flags[0].device)
        missing = list(range(len(flags)))
        polls = 0
        while True:
            missing = [i for i in missing if self._load(flags[i]) < epoch]
            if not missing or time.monotonic() >= deadline:
                return missing
            polls += 1
            if polls > _SPIN_POLLS:
                time.sleep(min(_MAX_SLEEP_S, max(0.0, deadline - time.monotonic())))

    @staticmethod
    def _load(flag: Region) -> int:
        if flag.device.type == "cpu":
            return host_atomics.load_acquire(flag.addr)
        return int(flag.view(FLAG_DTYPE).item())
