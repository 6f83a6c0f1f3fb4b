"""What every fused op does first: find the group's communicator, check a floating-point tensor,
and take the device API's context of the tensors' device."""

from __future__ import annotations

import torch

from gpucomm.comm.communicator import Communicator
from gpucomm.distributed.lookup import as_communicator
from gpucomm.distributed.world import get_default_communicator
from gpucomm.errors import UnsupportedError
from gpucomm.language.context import DeviceContext

__all__ = ["communicator", "check_float", "context", "recover", "FLOATS"]

# What the fused kernels compute in: fp32 accumulation, rounded once to these.
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def communicator(group: object, fn: str) -> Communicator:
    """The communicator of ``group`` (None: the default group's), found as every gpucomm call
    finds it (:func:`gpucomm.distributed.lookup.as_communicator`)."""
    if group is None:
        return get_default_communicator()
    return as_communicator(group, f"fused.{fn}")


def check_float(t: object, fn: str, name: str, dims: int, like: torch.Tensor | None = None) -> torch.Tensor:
    """A contiguous ``dims``-D tensor of one of :data:`FLOATS` (``like``'s dtype and device)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"gpucomm.fused.{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOATS:
        raise TypeError(f"gpucomm.fused.{fn}: {name} must be one of {[str(d) for d in FLOATS]}, got {t.dtype}")
    if like is not None and t.dtype != like.dtype:
        raise TypeError(f"gpucomm.fused.{fn}: {name} has dtype {t.dtype}, expected {like.dtype} like the first tensor")
    if like is not None and t.device != like.device:
        raise ValueError(f"gpucomm.fused.{fn}: {name} is on {t.device}, expected {like.device} like the first tensor")
    if t.dim() != dims:
        raise ValueError(f"gpucomm.fused.{fn}: {name} must have {dims} dimension(s), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(
            f"gpucomm.fused.{fn}: {name} must be contiguous (shape {tuple(t.shape)}, "
            f"strides {tuple(t.stride())}); call .contiguous() first"
        )
    return t


def context(comm: Communicator, t: torch.Tensor, fn: str) -> DeviceContext:
    """The device API's context of ``t``'s device on ``comm``, where Triton kernels run."""
    ctx = comm.device_context(t.device)
    if ctx.device.type == "cpu" and not _interpreted():
        raise UnsupportedError(
            f"gpucomm.fused.{fn}: CPU tensors run the fused Triton kernels only under TRITON_INTERPRET=1"
        )
    return ctx


def _interpreted() -> bool:
    from gpucomm._kernels.triton.clock import INTERPRETED

    return INTERPRETED


def recover(group: object = None, device: object = None) -> int:
    """Make the fused ops (and every kernel of the group's device context) usable again after
    one timed out: a collective, every rank of the group calls it. Returns the epoch every
    rank's channels start from again (:meth:`gpucomm.language.DeviceContext.recover`)."""
    comm = communicator(group, "recover")
    return comm.device_context(device).recover()
