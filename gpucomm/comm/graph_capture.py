"""A communicator's zero-copy CUDA graph captures: the context around captures, and the
registration that fills the captured kernels' operand tables (:mod:`gpucomm.workspace.graph_buffers`).

Kept apart from :mod:`gpucomm.comm.communicator` (its life cycle) because only graph users need it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["capturing_in_place", "register"]


def _graph_buffers(comm: object) -> list[object]:
    return [g for e in comm._engines.values() if (g := getattr(e.executor, "graphs", None)) is not None]


@contextlib.contextmanager
def capturing_in_place(comm: object, graph: object = None) -> Iterator[None]:
    """:meth:`Communicator.graph_capture`: in-place capture on while inside, registration on a clean exit."""
    graphs = _graph_buffers(comm)
    for g in graphs:
        g.enabled += 1
    try:
        yield
    except BaseException:
        for g in graphs:
            g.discard()  # a failed capture registers nothing
        raise
    finally:
        for g in graphs:
            g.enabled -= 1
    comm.register_graph_buffers(graph)


def register(comm: object, graph: object = None) -> None:
    """:meth:`Communicator.register_graph_buffers`, under the communicator's lock."""
    comm._check_usable("register_graph_buffers")
    with comm._lock:
        for g in _graph_buffers(comm):
            g.register(graph)
