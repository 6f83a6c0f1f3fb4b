"""DDP communication hooks that reduce gradient buckets with gpucomm.

In the shape of ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``: each hook is
``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` and is registered with
``ddp_model.register_comm_hook(GpucommState(), hook)``. DDP keeps its own process group (gloo,
NCCL, ...) for the initial broadcast and the parameter check; only the gradient buckets go
through gpucomm.

The hooks average with one ``all_reduce(op=AVG)``, which sums in fp32 for 16-bit tensors and
divides once at the end, on gloo and on the workspace path alike.
"""

# No ``from __future__ import annotations``: DDP compares the hooks' annotations with
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects, not strings.
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gpucomm.api import get_default_communicator
from gpucomm.communicator import Communicator
from gpucomm.reduce_op import ReduceOp

__all__ = ["GpucommState", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]


@dataclass
class GpucommState:
    """The state the hooks take: the Communicator to reduce on, or None for the default one
    (``gpucomm.init_process_group`` must have run before the first backward pass)."""

    comm: Communicator | None = None


def _communicator(state: GpucommState | None, hook: str) -> Communicator:
    if state is None:
        return get_default_communicator()
    if not isinstance(state, GpucommState):
        raise TypeError(f"gpucomm.ddp.{hook}: state must be a gpucomm.ddp.GpucommState or None, got {type(state).__name__}")
    return state.comm if state.comm is not None else get_default_communicator()


def _average(state: GpucommState | None, bucket: dist.GradBucket, dtype: torch.dtype, hook: str) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s buffer over the ranks, sending it as ``dtype``; the result lands in the buffer."""
    comm = _communicator(state, hook)
    buffer = bucket.buffer()
    wire = buffer.to(dtype)  # the same tensor when dtype is already the buffer's
    # No division before the reduce (torch's hooks divide first to keep fp16 sums from
    # overflowing): the sum is taken in fp32 inside the reduce, so it cannot overflow, and
    # dividing once afterwards saves a rounding in 16 bits.
    comm.all_reduce(wire, ReduceOp.AVG)
    if wire is not buffer:
        buffer.copy_(wire)  # decompress in place, as torch does, to keep peak memory down
    # The collective has returned and its kernels are queued on the current stream: a CUDA
    # Future records that stream now, and DDP's wait orders its own stream after it.
    fut: torch.futures.Future[torch.Tensor] = (
        torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
    )
    fut.set_result(buffer)
    return fut


def allreduce_hook(state: GpucommState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over all ranks with gpucomm's ``all_reduce``.

    Gives the same gradients as DDP without a hook (up to the rounding of dividing after the sum
    instead of before it).

    Example::
        >>> # xdoctest: +SKIP
        >>> gpucomm.init_process_group()
        >>> ddp_model.register_comm_hook(GpucommState(), allreduce_hook)
    """
    return _average(state, bucket, bucket.buffer().dtype, "allreduce_hook")


def bf16_compress_hook(state: GpucommState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send the bucket as bfloat16, sum it in fp32 inside the reduce, divide once, write it back.

    torch's ``bf16_compress_hook`` divides in bf16 before sending and sums in bf16 (one rounding per
    addition); here the only roundings are the compression of each rank's gradients and the final
    result's, so the averaged gradients are closer to an fp32 all-reduce (docs/ddp.md has numbers).

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(GpucommState(), bf16_compress_hook)
    """
    return _average(state, bucket, torch.bfloat16, "bf16_compress_hook")


# DDP refuses a hook *named* bf16_compress_hook unless NCCL >= 2.10 is present (it takes it for
# torch's own; see DistributedDataParallel._check_comm_hook). gpucomm's needs no NCCL.
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "gpucomm_bf16_compress_hook"


def fp16_compress_hook(state: GpucommState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send the bucket as float16, sum it in fp32 inside the reduce, divide once, write it back.

    Like :func:`bf16_compress_hook` with float16's 11-bit mantissa; values beyond float16's range
    (65504) overflow when compressed, as with torch's ``fp16_compress_hook``.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(GpucommState(), fp16_compress_hook)
    """
    return _average(state, bucket, torch.float16, "fp16_compress_hook")
