"""What a program's instructions name: workspace slots, the program's own buffers and the call's.

gpucomm.ops.program records instructions over these and re-exports them; the executors resolve
them to addresses when the program runs (its docstring: rounds, halves, positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpucomm.ops.contract import Region

__all__ = ["HalfOffset", "Slot", "Ref", "Arg", "resolve", "overlaps"]


@dataclass(frozen=True)
class HalfOffset:
    """``offset`` bytes into the half that holds the data of ``round`` (syncs since the start)."""

    round: int
    offset: int = 0

    def __add__(self, delta: int) -> HalfOffset:
        return HalfOffset(self.round, self.offset + delta)


@dataclass(frozen=True)
class Slot:
    """``nbytes`` bytes of local rank ``peer``'s workspace, ``offset`` bytes into the half of
    ``round``: a region whose address is known only when the program runs."""

    peer: int
    round: int
    offset: int
    nbytes: int

    def sub(self, offset: int, nbytes: int) -> Slot:
        """The ``nbytes`` bytes of this slot from ``offset``; ValueError if they leave it."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"Slot.sub: [{offset}, {offset + nbytes}) is outside a slot of {self.nbytes} bytes")
        return Slot(self.peer, self.round, self.offset + offset, nbytes)


@dataclass(frozen=True)
class Ref:
    """``nbytes`` bytes of this process's memory at ``addr`` that the program owns (a table it
    keeps in ``Program.keep``)."""

    addr: int
    nbytes: int


@dataclass(frozen=True)
class Arg:
    """``nbytes`` bytes, ``offset`` bytes into the call's buffer number ``index``.

    How a program names the caller's buffers: by their place in the call, never by a view (a
    view keeps the caller's tensor alive as long as the program is cached: 256 programs of fresh
    4 MiB tensors held 1.4 GiB per rank) nor by address (a loop that passes a fresh tensor each
    step would build a program each step). Executors resolve it with the call's addresses.
    """

    index: int
    offset: int
    nbytes: int


def resolve(operand: Ref | Arg, addrs: Sequence[int]) -> int:
    """The address of a program's own or the caller's operand, given the call's buffer addresses."""
    if isinstance(operand, Arg):
        return addrs[operand.index] + operand.offset
    return operand.addr


def overlaps(regions: Sequence[Region]) -> tuple:
    """How the call's buffers overlap: ``(i, j, addr_j - addr_i)`` for every overlapping pair.

    Part of a program's cache key: an operand inside two buffers (an in-place all_gather's input
    within its output) resolves to the buffer listed first, which names the same bytes in every
    call whose buffers overlap alike. Buffers that do not overlap (the usual case) give ``()``.
    """
    if len(regions) < 2:
        return ()
    found = []
    for i, a in enumerate(regions):
        for j in range(i + 1, len(regions)):
            b = regions[j]
            if a.addr < b.addr + b.nbytes and b.addr < a.addr + a.nbytes:
                found.append((i, j, b.addr - a.addr))
    return tuple(found)
