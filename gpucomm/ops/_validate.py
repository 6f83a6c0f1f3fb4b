"""Argument checks shared by every kernel implementation, done before any work is launched."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpucomm.ops.contract import FLAG_DTYPE, SUPPORTED_DTYPES, Region
from gpucomm.reduce_op import ReduceOp, as_reduce_op

__all__ = ["check_copy", "check_reduce", "check_flags", "check_epoch"]

_FLAG_BYTES = torch.empty(0, dtype=FLAG_DTYPE).element_size()


def _check_region(fn: str, what: str, region: object) -> Region:
    if not isinstance(region, Region):
        raise TypeError(f"{fn}: {what} must be a gpucomm.ops.Region, got {type(region).__name__}")
    return region


def check_copy(dst: Region, src: Region) -> None:
    _check_region("copy", "dst", dst)
    _check_region("copy", "src", src)
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy: dst and src must have the same size, got {dst.nbytes} and {src.nbytes} bytes")
    if dst.device.type != src.device.type:
        raise ValueError(f"copy: dst and src must be on the same kind of device, got {dst.device} and {src.device}")


def check_reduce(out: Region, srcs: Sequence[Region], dtype: torch.dtype, op: object, divisor: int) -> ReduceOp:
    """Check the arguments of ``reduce``; returns ``op`` as a gpucomm ReduceOp."""
    _check_region("reduce", "out", out)
    if len(srcs) == 0:
        raise ValueError("reduce: srcs must hold at least one region, got none")
    for i, src in enumerate(srcs):
        _check_region("reduce", f"srcs[{i}]", src)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"reduce: dtype must be one of {list(SUPPORTED_DTYPES)}, got {dtype}")
    op = as_reduce_op(op, "reduce")
    if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
        raise ValueError(f"reduce: divisor must be an int >= 1, got {divisor!r}")
    size = torch.empty(0, dtype=dtype).element_size()
    for i, region in enumerate([out, *srcs]):
        name = "out" if i == 0 else f"srcs[{i - 1}]"
        if region.nbytes != out.nbytes:
            raise ValueError(f"reduce: {name} has {region.nbytes} bytes, expected {out.nbytes} like out")
        if region.addr % size or region.nbytes % size:
            raise ValueError(
                f"reduce: {name} (address {region.addr:#x}, {region.nbytes} bytes) must be aligned to "
                f"and a multiple of the {size}-byte {dtype} element"
            )
        if region.device.type != out.device.type:
            raise ValueError(f"reduce: {name} is on {region.device}, expected the device type of out ({out.device})")
        # Elementwise in-place is safe only when out and the source are the same elements.
        overlaps = region.addr < out.addr + out.nbytes and out.addr < region.addr + region.nbytes
        if i and overlaps and region.addr != out.addr:
            raise ValueError(
                f"reduce: out ({out.addr:#x}) overlaps {name} ({region.addr:#x}) at a different offset; "
                "out may alias a source only exactly"
            )
    return op


def check_epoch(fn: str, epoch: int) -> None:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**63:
        raise ValueError(f"{fn}: epoch must be an int in [0, 2**63), got {epoch!r}")


def check_flags(fn: str, flags: Sequence[Region]) -> None:
    devices = set()
    for i, flag in enumerate(flags):
        _check_region(fn, f"flags[{i}]", flag)
        if flag.nbytes != _FLAG_BYTES or flag.addr % _FLAG_BYTES:
            raise ValueError(
                f"{fn}: flags[{i}] must be one aligned int64 ({_FLAG_BYTES} bytes at a multiple of "
                f"{_FLAG_BYTES}), got {flag.nbytes} bytes at {flag.addr:#x}"
            )
        devices.add(flag.device.type)
    if len(devices) > 1:
        raise ValueError(f"{fn}: all flags must be on one kind of device, got {sorted(devices)}")
