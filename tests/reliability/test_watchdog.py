"""The watchdog (gpucomm.reliability.watchdog): a poll asks only the oldest work of each queue,
drops ended works in order and reports their errors, and queries events in thread-local capture
mode, so that it never invalidates another thread's CUDA graph capture.
"""

from __future__ import annotations


class _PendingWork:
    """A Work that has not ended; counts how often it is asked."""

    asked = 0

    def is_completed(self) -> bool:
        _PendingWork.asked += 1
        return False

    def exception(self) -> None:
        return None


def test_watchdog_poll_asks_only_the_oldest_work_of_each_queue():
    """10,000 works in flight on one stream and 10 on another: a poll asks two works whether they
    ended (stream order: none after an unfinished one has), not 10,010; the poll used to compare
    every pending work with every ended one."""
    from gpucomm.reliability.watchdog import _Watchdog

    dog = _Watchdog()
    stream_a, stream_b = object(), object()
    for _ in range(10_000):
        dog.add(_PendingWork(), "all_reduce", 60.0, lambda err: None, 0, stream_a)
    for _ in range(10):
        dog.add(_PendingWork(), "all_reduce", 60.0, lambda err: None, 0, stream_b)
    _PendingWork.asked = 0
    dog.poll()
    assert _PendingWork.asked == 2
    assert dog.pending() == 10_010


def test_watchdog_drops_ended_works_in_order_and_reports_their_errors():
    from gpucomm.reliability.watchdog import _Watchdog

    class Ended(_PendingWork):
        def __init__(self, error=None):
            self.error = error

        def is_completed(self) -> bool:
            return True

        def exception(self):
            return self.error

    failures: list[BaseException] = []
    dog = _Watchdog()
    queue = object()
    boom = RuntimeError("kernel record")
    for work in (Ended(), Ended(boom), _PendingWork(), Ended()):
        dog.add(work, "broadcast", 60.0, failures.append, 0, queue)
    dog.poll()
    assert failures == [boom]
    assert dog.pending() == 2  # the unfinished work and the one behind it


# -- another thread's CUDA graph capture ----------------------------------------------------------
def test_watchdog_queries_events_in_thread_local_capture_mode(monkeypatch):
    """CUDA's rules, faked: while a thread captures in global mode, an event query from a thread
    whose capture mode is global invalidates the capture; from a thread in thread-local mode it
    does not. The watchdog's thread queries the works it watches during such a capture."""
    import threading
    import time

    import gpucomm.capture as capture
    from gpucomm.reliability.watchdog import _Watchdog

    modes = threading.local()  # the driver's per-thread capture mode; global by default
    state = {"capturing": True, "invalidated": False, "queries": 0}

    def exchange_mode(mode: int) -> int:
        previous = getattr(modes, "mode", capture.CAPTURE_MODE_GLOBAL)
        modes.mode = mode
        return previous

    class EventWork(_PendingWork):
        def is_completed(self) -> bool:
            state["queries"] += 1
            if (
                state["capturing"]
                and getattr(modes, "mode", capture.CAPTURE_MODE_GLOBAL) == capture.CAPTURE_MODE_GLOBAL
            ):
                state["invalidated"] = True
            return not state["capturing"]

    monkeypatch.setattr(capture, "_exchange_mode", exchange_mode)
    dog = _Watchdog()
    dog.watch(EventWork(), "all_reduce", 60.0, lambda err: None, 0, object())
    deadline = time.monotonic() + 10
    while state["queries"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    state["capturing"] = False
    assert state["queries"] >= 3, "the watchdog never polled"
    assert not state["invalidated"], "the watchdog queried an event in global capture mode during a capture"
