"""Input checks run before any data moves. Each error names the function and shows expected vs actual."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from gpucomm.comm.dtypes import check_dtype
from gpucomm.ops.program import overlaps

__all__ = [
    "check_tensor",
    "check_rank",
    "check_tensor_list",
    "check_same",
    "check_numel",
    "check_splits",
    "separate",
    "Separate",
]


def check_tensor(tensor: object, fn: str, name: str = "tensor", device: torch.device | None = None) -> torch.Tensor:
    """A contiguous tensor of a dtype gpucomm moves (gpucomm.comm.dtypes), on the CPU or on this rank's GPU."""
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
        raise ValueError(
            f"gpucomm.{fn}: {name} must have {expected} elements, got {tensor.numel()} (shape {tuple(tensor.shape)})"
        )


def check_splits(splits: Sequence[int] | None, world_size: int, total: int, fn: str, name: str) -> list[int]:
    """Split sizes along dim 0 for all_to_all_single; None means equal splits."""
    if splits is None or len(splits) == 0:
        if total % world_size:
            raise ValueError(
                f"gpucomm.{fn}: dim 0 of the tensor ({total}) must divide by world_size = {world_size} when {name} "
                "is not given"
            )
        return [total // world_size] * world_size
    splits = list(splits)
    if len(splits) != world_size or any((not isinstance(s, int)) or s < 0 for s in splits):
        raise ValueError(f"gpucomm.{fn}: {name} must be {world_size} non-negative ints, got {splits}")
    if sum(splits) != total:
        raise ValueError(f"gpucomm.{fn}: {name} sums to {sum(splits)}, but dim 0 of the tensor is {total}")
    return splits


class _Span(NamedTuple):
    """The bytes of a contiguous tensor, as :func:`gpucomm.ops.program.overlaps` compares them."""

    addr: int
    nbytes: int


def _span(tensor: torch.Tensor) -> _Span:
    return _Span(tensor.data_ptr(), tensor.numel() * tensor.element_size())


@dataclass
class Separate:
    """A call's buffers as its path may use them (see :func:`separate`).

    ``inputs`` and ``outputs`` are the caller's tensors or, where they overlap, buffers of their
    own; ``write_back`` copies the outputs received apart into the caller's, in list order.
    """

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (caller's, own)

    def write_back(self) -> None:
        for mine, own in self.staged:
            mine.copy_(own)


def separate(
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    in_place: Mapping[tuple[int, int], int] | None = None,
) -> Separate:
    """Stage what overlaps, so that a collective gives the result it gives on separate buffers.

    The rule for every collective that takes more than one buffer, on every path: an input
    whose bytes overlap an output's is copied aside before the call, and outputs whose bytes
    overlap each other are received into buffers of their own and copied into the caller's in
    list order once the call is complete (where they overlap, the one listed last wins), which
    is what gloo gives. Inputs may overlap each other: they are only read. Nothing is raised:
    each rank judges its own buffers and stages them on its own, so the ranks never need to
    agree about it, and the exchange is the same whatever a rank staged.

    ``in_place`` holds the documented in-place forms of the call, which run as they are:
    ``{(input index, output index): input address - output address}`` (all_gather_into_tensor's
    input as this rank's chunk of the output: ``rank * input bytes``). A pair that overlaps at
    another offset, or whose output is received apart, is staged like any other.
    """
    spans = [_span(t) for t in outputs] + [_span(t) for t in inputs]
    pairs = overlaps(spans)
    if not pairs:  # the usual case: nothing shares a byte
        return Separate(list(inputs), list(outputs))
    k = len(outputs)
    apart = sorted({n for i, j, _ in pairs if j < k for n in (i, j)})  # outputs overlapping outputs
    forms = in_place or {}
    # Outputs come first in ``spans``, so an output-input pair is (output, k + input).
    copied = {j - k for i, j, offset in pairs if i < k <= j and (i in apart or forms.get((j - k, i)) != offset)}
    own = {i: torch.empty_like(outputs[i]) for i in apart}
    return Separate(
        [t.clone() if n in copied else t for n, t in enumerate(inputs)],
        [own.get(n, t) for n, t in enumerate(outputs)],
        [(outputs[n], own[n]) for n in apart],
    )
