"""Conjugate and negative views: each collective serves them as the plain tensors they stand for.

``x.conj()`` of a complex tensor and ``torch._neg_view(x)`` are lazy views: their memory holds
``x``'s values, and a bit on the view says to conjugate or negate them on read. Collectives move
memory, so such a view would travel as the values it does not stand for (torch's gloo sends a
negative view's memory as it is), or be refused by the first reinterpretation of its bytes
(``view_as_real``, ``.view(dtype)``) on the rank that passed it alone, leaving its peers inside
the call: a broadcast whose root passed ``x.conj()`` broke the group.

Every rank serves the call on a resolved copy of each such view (its values, in plain memory)
and writes the copy back into the view once the collective is complete, so that a view the
collective writes (all_reduce's tensor, an all_gather output) gets its result. What the peers
see is the same as for a plain tensor: nothing needs agreeing, and a rank that passes a view
while its peers pass plain tensors is served like them.

Example::

    z = torch.tensor([1 + 2j, 3 - 4j])
    gpucomm.broadcast(z.conj(), src=0)  # the peers receive [1 - 2j, 3 + 4j]
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from gpucomm.work import Work

__all__ = ["resolving", "is_lazy"]

F = TypeVar("F", bound=Callable[..., object])


def _lazy(value: object) -> bool:
    """A contiguous conjugate or negative view: served on a copy. (A strided one is left to
    validation, which refuses it as it refuses a strided plain tensor.)"""
    return isinstance(value, torch.Tensor) and (value.is_conj() or value.is_neg()) and value.is_contiguous()


def is_lazy(value: object) -> bool:
    """Whether ``value`` is a lazy view served on a copy, or a list or tuple holding one."""
    if isinstance(value, (list, tuple)):
        return any(_lazy(t) for t in value)
    return _lazy(value)


class _Resolved:
    """Resolved copies of a call's lazy views, and their write-back."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the caller's view, its copy)

    def resolve(self, value: object) -> object:
        if isinstance(value, torch.Tensor):
            if not _lazy(value):
                return value
            # clone() keeps the lazy bits; resolve_*() give plain memory (contiguous if the view is).
            copy = value.resolve_conj().resolve_neg()
            self.pairs.append((value, copy))
            return copy
        if isinstance(value, (list, tuple)):
            return type(value)(self.resolve(t) for t in value)
        return value

    def original(self, tensor: torch.Tensor) -> torch.Tensor:
        for view, copy in self.pairs:
            if copy is tensor:
                return view
        return tensor

    def write_back(self) -> None:
        with torch.no_grad():
            for view, copy in self.pairs:
                view.copy_(copy)  # through the view's bits: it reads back as the result


def resolving(method: F) -> F:
    """Serve ``method`` (a collective of a communicator) on resolved copies of its lazy views."""

    @functools.wraps(method)
    def call(self: object, *args: object, **kwargs: object) -> object:
        if not any(is_lazy(a) for a in args) and not any(is_lazy(v) for v in kwargs.values()):
            return method(self, *args, **kwargs)
        resolved = _Resolved()
        args = tuple(resolved.resolve(a) for a in args)
        kwargs = {k: resolved.resolve(v) for k, v in kwargs.items()}
        result = method(self, *args, **kwargs)
        if not isinstance(result, Work):  # a blocking call (recv's source rank, or None): it has run
            resolved.write_back()
            return result
        return Work(
            [result],
            resolved.write_back,
            outputs=[resolved.original(t) for t in result.outputs],
            blocking=result.blocking,
            side_stream=result.side_stream,
        )

    return call  # type: ignore[return-value]
