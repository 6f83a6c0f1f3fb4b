"""The kernel contract: what every kernel implementation (torch, Triton, CUDA C++) provides.

Kernels address memory by raw addresses valid in this process: a local tensor, a peer's
workspace mapped through CUDA IPC or POSIX shared memory. A :class:`Region` carries the address
together with a byte view of the same memory, so pointer-based kernels use ``addr`` and the torch
reference uses ``bytes``; both describe exactly the same bytes.

Semantics every implementation keeps (and the tests check against the torch reference):

- ``copy(dst, src)``: ``dst.nbytes == src.nbytes`` bytes from src to dst; either may be a peer.
- ``reduce(out, srcs, dtype, op, divisor)``: ``out[i] = op(srcs[0][i], srcs[1][i], ...)`` folded
  left to right in the order given (so every rank that passes the same order gets bitwise the
  same result); 16-bit floats accumulate in fp32 and round once to nearest-even; AVG is SUM
  divided once by ``divisor`` in the accumulation type (truncating for integers). ``out`` may
  alias one of the sources at the same offset.
- ``signal(flags, epoch)``: after all earlier writes of this rank (stream order on a GPU),
  store ``epoch`` into every flag with release semantics at system scope.
- ``wait(flags, epoch, deadline)``: acquire-load every flag until each is ``>= epoch`` or the
  wall clock passes ``deadline`` (``time.monotonic()``); returns the indices of the flags still
  below ``epoch`` (empty on success). It never blocks past the deadline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from gpucomm.reduce_op import ReduceOp

__all__ = ["Region", "Kernels", "SUPPORTED_DTYPES", "FLAG_DTYPE", "alias_bytes"]

SUPPORTED_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.int64,
)

# Flags are monotonic int64 epoch counters, never reset.
FLAG_DTYPE = torch.int64


@dataclass(frozen=True)
class Region:
    """``nbytes`` bytes at ``addr``; ``bytes`` is a uint8 tensor viewing the same memory."""

    addr: int
    nbytes: int
    bytes: torch.Tensor

    @staticmethod
    def of(tensor: torch.Tensor) -> Region:
        """The region of a contiguous tensor."""
        # Strides of size-1 dims are free in a contiguous tensor (one element of x[::2] has
        # stride 2), and a byte view needs stride 1: the flat view is made with it.
        flat = tensor.as_strided((tensor.numel(),), (1,))
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)
        return Region(tensor.data_ptr(), tensor.numel() * tensor.element_size(), raw)

    def sub(self, offset: int, nbytes: int) -> Region:
        """The ``nbytes`` bytes starting ``offset`` bytes in."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"Region.sub: [{offset}, {offset + nbytes}) is outside a region of {self.nbytes} bytes")
        return Region(self.addr + offset, nbytes, self.bytes[offset : offset + nbytes])

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        """The region as a 1-D tensor of ``dtype``."""
        return self.bytes.view(dtype)

    @property
    def device(self) -> torch.device:
        return self.bytes.device

    @staticmethod
    def alias(addr: int, nbytes: int, device: torch.device) -> Region:
        """The region of ``nbytes`` bytes at ``addr`` on ``device``, viewed without owning them.

        The view keeps no tensor and no allocation alive: it is valid while whoever owns the
        memory keeps it (a workspace mapping, or the caller's tensor during a call that names it).
        """
        return Region(addr, nbytes, alias_bytes(addr, nbytes, device))


def alias_bytes(addr: int, nbytes: int, device: torch.device, owner: object = None) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` bytes at ``addr`` that does not own them, and whose
    ``data_ptr()`` is ``addr`` (checked: a copy would read stale data forever after). On a GPU
    the tensor's storage keeps ``owner`` alive (None: nothing)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if device.type == "cpu":
        import ctypes

        view = torch.frombuffer((ctypes.c_ubyte * nbytes).from_address(addr), dtype=torch.uint8)
    elif device.type == "cuda":
        import cupy

        dev = device.index if device.index is not None else torch.cuda.current_device()
        memory = cupy.cuda.UnownedMemory(addr, nbytes, owner, dev)
        array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        # DLPack carries the device cupy was given; torch.as_tensor may instead infer the device
        # from the pointer (a peer GPU's) and copy to the one asked for, depending on the version.
        view = torch.from_dlpack(array)
    else:
        raise ValueError(f"Region.alias: device must be cpu or cuda, got {device}")
    if (
        view.data_ptr() != addr
        or view.device.type != device.type
        or (device.index is not None and view.device != device)
    ):
        raise RuntimeError(
            f"Region.alias: the view of {nbytes} bytes at {addr:#x} on {device} is at {view.data_ptr():#x} on "
            f"{view.device}: it would be a copy, not an alias"
        )
    return view


class Kernels(Protocol):
    """One implementation of the kernel contract (see the module docstring)."""

    name: str

    def copy(self, dst: Region, src: Region) -> None: ...

    def reduce(
        self,
        out: Region,
        srcs: Sequence[Region],
        dtype: torch.dtype,
        op: ReduceOp,
        divisor: int = 1,
    ) -> None: ...

    def signal(self, flags: Sequence[Region], epoch: int) -> None: ...

    def wait(self, flags: Sequence[Region], epoch: int, deadline: float) -> list[int]: ...
