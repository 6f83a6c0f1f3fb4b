"""The watchdog: one thread per process that watches the collectives still in flight.

A collective whose completion the caller does not wait for (a GPU collective queued on a
communicator's stream, an asynchronous gloo call) can fail while the caller is busy elsewhere:
a peer dies, a kernel's wait times out, gloo gives up. The watchdog polls every pending Work
(without waiting for anything: end events, kernels' error records, gloo works' states) and the
wall clock. On a failure, or a collective that has not ended by its communicator's timeout plus
a grace period, it marks the communicator broken with the error and logs one line naming the
call and the missing ranks; the error then surfaces at the next call or wait on that
communicator, on every rank (each rank's watchdog finds its own side of the failure). With
``GPUCOMM_ASYNC_ERROR_HANDLING=abort`` the communicator ends the process instead, as NCCL's
asynchronous error handling does.

The watchdog also holds the pending Works, and so the buffers their kernels use, until they end.
It never watches works recorded into a CUDA graph (an event of a capture cannot be queried).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpucomm.errors import CommTimeoutError
from gpucomm.work import Work

__all__ = ["watch", "stop", "POLL_S", "GRACE_S"]

# How often pending works are looked at: a failure is reported within this much of happening.
POLL_S = 0.05
# A collective that has not ended by its timeout plus this much is declared stuck (its kernels'
# own deadlines, or gloo's, normally end it first and name the culprit).
GRACE_S = 5.0


@dataclass
class _Watched:
    work: Work
    name: str
    deadline: float
    fail: Callable[[BaseException], None]  # the communicator's: broken, logged (or aborted)
    rank: int
    timeout: float


class _Watchdog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: list[_Watched] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # of the running thread; each thread gets its own

    def watch(self, work: Work, name: str, timeout: float, fail: Callable[[BaseException], None], rank: int) -> None:
        with self._lock:
            self._watched.append(_Watched(work, name, time.monotonic() + timeout + GRACE_S, fail, rank, timeout))
            if self._thread is None or not self._thread.is_alive():
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(self._stop,), name="gpucomm-watchdog", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """End the thread and forget what it watched (no communicator is open any more, or the
        process exits); a later :meth:`watch` starts a new one.

        Why at exit: a daemon thread still running when the interpreter finalises is ended where
        it next takes the GIL; inside a torch call (a gloo work's ``wait``) that is a C++
        destructor, and the process aborts with "terminate called without an active exception".
        """
        with self._lock:
            thread, self._thread = self._thread, None
            self._watched = []
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(POLL_S):
            with self._lock:
                watched = list(self._watched)
            ended = [w for w in watched if self._ended(w)]
            if ended:
                with self._lock:
                    self._watched = [w for w in self._watched if w not in ended]

    @staticmethod
    def _ended(w: _Watched) -> bool:
        if w.work.is_completed():
            error = w.work.exception()
            if error is not None:
                w.fail(error)
            return True
        if time.monotonic() < w.deadline:
            return False
        w.fail(CommTimeoutError(w.name, None, w.rank, [], w.timeout, detail=f"the collective had not ended {GRACE_S:g} s after its timeout"))
        return True


_WATCHDOG = _Watchdog()


def watch(work: Work, name: str, timeout: float, fail: Callable[[BaseException], None], rank: int) -> None:
    """Watch ``work`` until it ends; ``fail(error)`` if it fails or outlives ``timeout``."""
    _WATCHDOG.watch(work, name, timeout, fail, rank)


def stop() -> None:
    """End the watchdog's thread now (see :meth:`_Watchdog.stop`)."""
    _WATCHDOG.stop()
