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

__all__ = ["TorchKernels"]

# Host polling backs off from busy spinning to short sleeps, so that a rank waiting on a slow
# peer does not starve it of a core (CI machines have two).
_SPIN_POLLS = 200
_MAX_SLEEP_S = 1e-3


def _fold(acc: torch.Tensor, x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    if op == ReduceOp.PRODUCT:
        return torch.mul(acc, x)
    if op == ReduceOp.MIN:
        return torch.minimum(acc, x)  # NaN propagates
    if op == ReduceOp.MAX:
        return torch.maximum(acc, x)
    return torch.add(acc, x)  # SUM and AVG


def _divide(acc: torch.Tensor, divisor: int) -> torch.Tensor:
    if not acc.is_floating_point():
        return torch.div(acc, divisor, rounding_mode="trunc")
    # A tensor divisor, not a Python scalar: CUDA torch turns division by a scalar into a
    # multiplication by its reciprocal, which is not the correctly rounded quotient.
    return torch.div(acc, torch.full_like(acc, divisor))


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
        acc_dtype = accumulation_dtype(dtype)
        # .to() copies for 16-bit floats, and _fold/_divide make new tensors, so every source is
        # read before out is written: out may alias a source.
        acc = srcs[0].view(dtype).to(acc_dtype)
        for src in srcs[1:]:
            acc = _fold(acc, src.view(dtype).to(acc_dtype), op)
        if op == ReduceOp.AVG:
            acc = _divide(acc, divisor)
        out.view(dtype).copy_(acc)  # the one rounding, to nearest even

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
