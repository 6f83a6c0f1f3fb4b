"""Input checks run before any data moves. Each error names the function and shows expected vs actual."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpucomm.dtypes import check_dtype

__all__ = ["check_tensor", "check_rank", "check_tensor_list", "check_same", "check_numel", "check_splits"]


def check_tensor(
    tensor: object, fn: str, name: str = "tensor", device: torch.device | None = None
) -> torch.Tensor:
    """A contiguous tensor of a dtype gpucomm moves (gpucomm.dtypes), on the CPU or on this rank's GPU."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"gpucomm.{fn}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    check_dtype(tensor, fn, name)
    if not tensor.is_contiguous():
        raise ValueError(
            f"gpucomm.{fn}: {name} must be contiguous (got shape {tuple(tensor.shape)} with strides "
            f"{tuple(tensor.stride())}); call .contiguous() first"
        )
    if tensor.device.type == "cuda" and device is not None and device.type == "cuda" and tensor.device != device:
        raise ValueError(f"gpucomm.{fn}: {name} is on {tensor.device}, but this rank's device is {device}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"gpucomm.{fn}: {name} is on {tensor.device}; expected a cpu or cuda tensor")
    return tensor


def check_rank(rank: object, world_size: int, fn: str, name: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"gpucomm.{fn}: {name} must be an int, got {type(rank).__name__}")
    if not 0 <= rank < world_size:
        raise ValueError(f"gpucomm.{fn}: {name} must be in [0, {world_size}), got {rank}")
    return rank


def check_tensor_list(
    tensors: object, length: int, fn: str, name: str, like: torch.Tensor, device: torch.device | None = None
) -> list[torch.Tensor]:
    """``length`` tensors, each with the dtype, device and element count of ``like``."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"gpucomm.{fn}: {name} must be a list of tensors, got {type(tensors).__name__}")
    if len(tensors) != length:
        raise ValueError(f"gpucomm.{fn}: {name} must hold world_size = {length} tensors, got {len(tensors)}")
    checked = []
    for i, t in enumerate(tensors):
        t = check_tensor(t, fn, f"{name}[{i}]", device)
        check_same(t, like, fn, f"{name}[{i}]")
        check_numel(t, like.numel(), fn, f"{name}[{i}]")
        checked.append(t)
    return checked


def check_same(tensor: torch.Tensor, like: torch.Tensor, fn: str, name: str) -> None:
    if tensor.dtype != like.dtype:
        raise TypeError(f"gpucomm.{fn}: {name} has dtype {tensor.dtype}, expected {like.dtype} like the other tensors")
    if tensor.device != like.device:
        raise ValueError(f"gpucomm.{fn}: {name} is on {tensor.device}, expected {like.device} like the other tensors")


def check_numel(tensor: torch.Tensor, expected: int, fn: str, name: str) -> None:
    if tensor.numel() != expected:
        raise ValueError(f"gpucomm.{fn}: {name} must have {expected} elements, got {tensor.numel()} (shape {tuple(tensor.shape)})")


def check_splits(splits: Sequence[int] | None, world_size: int, total: int, fn: str, name: str) -> list[int]:
    """Split sizes along dim 0 for all_to_all_single; None means equal splits."""
    if splits is None or len(splits) == 0:
        if total % world_size:
            raise ValueError(f"gpucomm.{fn}: dim 0 of the tensor ({total}) must divide by world_size = {world_size} when {name} is not given")
        return [total // world_size] * world_size
    splits = list(splits)
    if len(splits) != world_size or any((not isinstance(s, int)) or s < 0 for s in splits):
        raise ValueError(f"gpucomm.{fn}: {name} must be {world_size} non-negative ints, got {splits}")
    if sum(splits) != total:
        raise ValueError(f"gpucomm.{fn}: {name} sums to {sum(splits)}, but dim 0 of the tensor is {total}")
    return splits
