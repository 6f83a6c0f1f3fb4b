"""Every dtype torch can send, on paths that natively move six.

Both paths (the workspace and gloo) move and reduce fp32, fp16, bf16, fp64, int32 and int64
natively. The Communicator hands them every other dtype through this module:

- **data movement** (broadcast, all_gather, gather, scatter, all_to_all, send/recv): the
  tensor is viewed as bytes (a uint8 view of the same memory, one trailing dimension of
  ``itemsize`` bytes, so dim 0 and split sizes along it keep their meaning). Nothing is copied.
- **reductions**: the tensor is staged in a native accumulation type, reduced there, and written
  back once:

  ============================  ===========  ==============================================
  dtype                         reduced as   semantics
  ============================  ===========  ==============================================
  float8 (e4m3fn, e5m2, fnuz)   float32      summed in fp32, rounded once to the dtype
  int8, uint8, int16, uint16    int32        SUM and PRODUCT wrap around modulo 2**bits, as
  uint32                        int64        torch's integer arithmetic and gloo do; MIN and
                                             MAX exact; AVG = the exact sum divided by the
                                             number of ranks, truncated towards zero (the
                                             wide sum cannot overflow)
  uint64                        int64 bits   SUM and PRODUCT wrap modulo 2**64; MIN and MAX
                                             compare unsigned; AVG refused (its sum needs 65
                                             bits)
  bool                          int32        SUM and MAX = logical or, PRODUCT and MIN =
                                             logical and (what gloo computes, and what torch
                                             maps them to for NCCL); AVG refused
  complex32, complex64,         its real     SUM and AVG on the real and imaginary parts
  complex128                    view         (fp16 parts accumulate in fp32); PRODUCT, MIN
                                             and MAX refused, as torch.distributed does
  ============================  ===========  ==============================================

float8_e8m0fnu and float4_e2m1fn_x2 move but do not reduce (neither torch nor gloo sums them).
Every refusal is a ``TypeError`` naming the user's function, raised before any data moves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gpucomm.ops.contract import SUPPORTED_DTYPES as NATIVE
from gpucomm.reduce_op import ReduceOp

__all__ = ["MOVABLE", "REDUCIBLE", "NATIVE", "check_dtype", "as_bytes", "Staged", "staged"]


def _present(*names: str) -> tuple[torch.dtype, ...]:
    """The dtypes of these names that this torch has (torch 2.11 lacks some of 2.13's)."""
    return tuple(getattr(torch, n) for n in names if hasattr(torch, n))


_FLOAT8 = _present("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
_SMALL_INTS = (torch.bool, torch.uint8, torch.int8, torch.int16, *_present("uint16"))
_UINT32 = _present("uint32")
_UINT64 = _present("uint64")
_COMPLEX = (torch.complex32, torch.complex64, torch.complex128)
_MOVE_ONLY = _present("float8_e8m0fnu", "float4_e2m1fn_x2")

REDUCIBLE = (*NATIVE, *_FLOAT8, *_SMALL_INTS, *_UINT32, *_UINT64, *_COMPLEX)
MOVABLE = (*REDUCIBLE, *_MOVE_ONLY)

_NAMES = ", ".join(str(d).removeprefix("torch.") for d in MOVABLE)
_SIGN_BIT = -(1 << 63)  # int64 with only the sign bit set


def check_dtype(tensor: torch.Tensor, fn: str, name: str) -> None:
    if tensor.dtype not in MOVABLE:
        raise TypeError(f"gpucomm.{fn}: {name} has dtype {tensor.dtype}; supported dtypes are {_NAMES}")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself if a path moves its dtype natively, else a uint8 view of its memory
    (shape ``(*tensor.shape, itemsize)``: dim 0 and every split along it are unchanged)."""
    if tensor.dtype in NATIVE:
        return tensor
    return tensor.unsqueeze(-1).view(torch.uint8)


class Staged:
    """The wire tensors of one reducing call in their native type, and the write-back.

    ``wire[i]`` is ``tensors[i]`` itself (native dtypes), a view of it (complex), or a copy in
    the accumulation type; ``op`` is the operator the path applies to the wire tensors.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp,
        encode: Callable[[torch.Tensor], torch.Tensor] | None,
        decode: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None,
    ) -> None:
        self.originals = list(tensors)
        self.op = op
        self._decode = decode
        self.wire = [t if encode is None else encode(t) for t in self.originals]

    def write_back(self, indices: Sequence[int] | None = None) -> None:
        """Copy the results of ``wire[i]`` (all, or ``indices``) into the caller's tensors."""
        if self._decode is None:
            return
        for i in range(len(self.wire)) if indices is None else indices:
            self.originals[i].copy_(self._decode(self.wire[i], self.originals[i].dtype))


def _refuse(fn: str, dtype: torch.dtype, op: ReduceOp, why: str) -> TypeError:
    return TypeError(f"gpucomm.{fn}: ReduceOp.{op.name} is not defined on {dtype} tensors ({why})")


def staged(tensors: Sequence[torch.Tensor], op: ReduceOp, fn: str, scale: float | None = None) -> Staged:
    """Stage ``tensors`` (one dtype) of a reduction with ``op``; ``TypeError`` if it has none.

    ``scale``: ``ReduceOp.PREMUL_SUM(scale)`` (``op`` is SUM): each rank's tensor is multiplied
    by ``scale`` in its own dtype, on a copy, before the sum.
    """
    dtype = tensors[0].dtype
    if scale is not None:
        if not (dtype.is_floating_point or dtype.is_complex) or dtype in _MOVE_ONLY:
            raise TypeError(f"gpucomm.{fn}: PREMUL_SUM takes floating point or complex tensors, got {dtype}")

        def premultiplied(t: torch.Tensor) -> torch.Tensor:
            w = (t.to(torch.float32) if dtype in _FLOAT8 else t) * scale  # float8 has no multiply
            return torch.view_as_real(w) if w.is_complex() else w

        return Staged(tensors, ReduceOp.SUM, premultiplied, _from_wire)
    if dtype in NATIVE:
        return Staged(tensors, op, None, None)
    if dtype in _COMPLEX:
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise _refuse(
                fn,
                dtype,
                op,
                "complex numbers have no order and torch.distributed multiplies them by parts; SUM and AVG are",
            )
        return Staged(tensors, op, torch.view_as_real, None)
    if dtype in _FLOAT8:
        return Staged(tensors, op, lambda t: t.to(torch.float32), _cast)
    if dtype == torch.bool:
        if op is ReduceOp.AVG:
            raise _refuse(
                fn, dtype, op, "a mean of booleans is not a boolean; SUM/MAX give logical or, PRODUCT/MIN logical and"
            )
        logical = ReduceOp.MAX if op in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN
        return Staged(tensors, logical, lambda t: t.to(torch.int32), _cast)
    if dtype in _SMALL_INTS:
        return Staged(tensors, op, lambda t: t.to(torch.int32), _cast)
    if dtype in _UINT32:
        return Staged(tensors, op, lambda t: t.to(torch.int64), _cast)
    if dtype in _UINT64:
        if op is ReduceOp.AVG:
            raise _refuse(fn, dtype, op, "the exact sum of uint64 values needs 65 bits")
        if op in (ReduceOp.MIN, ReduceOp.MAX):
            # Flipping the sign bit maps unsigned order onto signed order, both ways.
            return Staged(tensors, op, lambda t: t.view(torch.int64) ^ _SIGN_BIT, _unflip)
        # Two's complement addition and multiplication are the same bits as unsigned ones.
        return Staged(tensors, op, lambda t: t.view(torch.int64).clone(), _bits)
    raise _refuse(fn, dtype, op, "it moves through every collective but no backend reduces it")


def _from_wire(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A wire tensor (the accumulation type, or the real view of a complex one) as ``dtype``."""
    return torch.view_as_complex(wire) if dtype.is_complex else wire.to(dtype)


def _cast(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round (floats) or wrap (integers) once into ``dtype``; nonzero -> True for bool."""
    return wire.to(dtype)


def _unflip(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (wire ^ _SIGN_BIT).view(dtype)


def _bits(wire: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return wire.view(dtype)
