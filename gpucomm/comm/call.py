"""``Call``: one validated collective, as its method built it for the route.

A collective method of the communicator checks the caller's arguments, puts the tensors in their
wire form (:mod:`gpucomm.comm.dtypes`) and describes the call in a :class:`Call`; the route
(:mod:`gpucomm.comm.route`) numbers it, picks its :class:`~gpucomm.comm.path.Path`, logs and
records it, and runs ``call.serve`` on that path.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Mapping, Sequence

import torch

from gpucomm.comm.path import Path
from gpucomm.work import Work

__all__ = ["Call", "POINT_TO_POINT", "UNEVEN_SIZES"]

POINT_TO_POINT = ("send", "recv", "isend", "irecv")
# Collectives whose tensors may differ in size between ranks (split sizes, per-pair lists).
UNEVEN_SIZES = ("all_to_all", "all_to_all_single")


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective call, validated and in wire form.

    Attributes:
        fn: the collective's name ("all_reduce", "isend", ...).
        tensor: what travels (the wire form), which picks the path; None for a barrier.
        serve: starts the collective on a path; returns the path's Work.
        async_op: the caller gets a Work instead of waiting.
        finish: runs once the path's work is complete (writes a staged result back into the
            caller's tensor); None where nothing is staged.
        outputs: the caller's tensors, which ``Work.result()`` returns.
        blocking: ``wait()`` blocks the host on a GPU too (a barrier), whatever the knob says.
        fields: the call's options (op, root, peer, tag, the caller's dtype), for the log, the
            flight record and the fingerprint every rank must agree on.
    """

    fn: str
    tensor: torch.Tensor | None
    serve: Callable[[Path], Work]
    async_op: bool = False
    finish: Callable[[], None] | None = None
    outputs: Sequence[torch.Tensor] = ()
    blocking: bool = False
    fields: Mapping[str, object] = dataclasses.field(default_factory=dict)

    @property
    def point_to_point(self) -> bool:
        """A send or recv: not numbered, never checked, matched by tag instead."""
        return self.fn in POINT_TO_POINT

    @property
    def peer(self) -> int | None:
        """The other rank of a send or recv (None: any sender, or a collective)."""
        return self.fields.get("peer") if self.point_to_point else None  # type: ignore[return-value]

    def fingerprint(self) -> int:
        """What every rank must agree on for the call: the collective, its options (op, root, the
        caller's dtype), the wire dtype and, but for all_to_all, the element count: 63 bits of a
        BLAKE2b hash (a non-negative int64, the checked gloo exchange's first word). A 32-bit CRC
        once stood here: linear, so that thousands of element counts shared their value."""
        parts: list[object] = [self.fn, *sorted(self.fields.items())]
        if self.tensor is not None:
            parts.append(self.tensor.dtype)
            if self.fn not in UNEVEN_SIZES:
                parts.append(self.tensor.numel())
        return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


def sent_as(tensor: torch.Tensor, wire: torch.Tensor) -> dict[str, str]:
    """The caller's dtype, for the log and the call's fingerprint, where the wire form differs."""
    if wire.dtype == tensor.dtype:
        return {}
    return {"user_dtype": str(tensor.dtype).removeprefix("torch.")}
