"""``Communicator.barrier`` returns only once every rank has arrived: its Work waits on the host,
also where the barrier's kernel is queued on a stream (on a GPU), as a barrier does on NCCL.
"""

from __future__ import annotations


def test_barrier_waits_on_the_host(monkeypatch):
    """On a GPU the barrier's kernel is queued on a stream; the call must still return only once
    every rank has arrived, so its Work waits on the host (``blocking``), as a barrier does on
    NCCL. Shown with the path's Work faked: it records how it was waited for."""
    from gpucomm.comm.communicator import Communicator

    waits: list[bool] = []
    calls = []

    class QueuedWork:
        """The Work the route builds: ``blocking`` is the call's (or GPUCOMM_BLOCKING_WAIT's)."""

        def __init__(self, blocking: bool) -> None:
            self.blocking = blocking

        def wait(self) -> bool:
            waits.append(self.blocking)
            return True

    comm = Communicator.__new__(Communicator)
    comm._closed, comm._broken = False, None
    monkeypatch.setattr(Communicator, "_route", lambda self, call: calls.append(call) or QueuedWork(call.blocking))
    assert comm.barrier() is None
    assert waits == [True]
    work = comm.barrier(async_op=True)
    assert work.blocking is True
    assert [(call.fn, call.blocking) for call in calls] == [("barrier", True)] * 2
