"""The watchdog: one thread per process that watches the collectives still in flight.

A collective whose completion the caller does not wait for (a GPU collective queued on a
communicator's stream, an asynchronous gloo call) can fail while the caller is busy elsewhere:
a peer dies, a kernel's wait times out, gloo gives up. The watchdog polls the pending Works
(without waiting for anything: end events, kernels' error records, gloo works' states) and the
wall clock. On a failure, or a collective that has not ended by its communicator's timeout plus
a grace period, it marks the communicator broken with the error and logs one line naming the
call and the missing ranks; the error then surfaces at the next call or wait on that
communicator, on every rank (each rank's watchdog finds its own side of the failure). With
``GPUCOMM_ASYNC_ERROR_HANDLING=abort`` the communicator ends the process instead, as NCCL's
asynchronous error handling does.

A collective on the workspace that has run for a while is also looked at for a lost peer (a
process on this host gone: :mod:`gpucomm.reliability.lost`, from 0.5 s into the collective, every
0.25 s at most): the communicator is marked broken with :class:`PeerLostError` then, within a
second or so of the death, while the work is still held until its kernel's own deadline ends it
(its error is not reported a second time).

Works are watched in queues, one per order in which they complete (a communicator's CUDA stream;
its gloo group), oldest first. A poll looks at the oldest work of each queue and moves on only
once it has ended, so its cost does not grow with the works in flight (comparing every pending
work with every ended one took 131 ms of each 50 ms poll at 1,200 works). The oldest work of
a queue also has its earliest deadline, since a queue's works share their communicator's timeout.

The watchdog holds the pending Works, and so the buffers their kernels use, until they end. It
never watches works recorded into a CUDA graph, and it queries events in thread-local capture
mode, so that another thread's capture is never invalidated (:mod:`gpucomm.capture`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from gpucomm.capture import enter_thread_local_capture_mode
from gpucomm.errors import CommTimeoutError, PeerLostError
from gpucomm.work import Work

__all__ = ["watch", "forget", "stop", "POLL_S", "GRACE_S"]

# How often pending works are looked at: a failure is reported within this much of happening.
POLL_S = 0.05
# A collective that has not ended by its timeout plus this much is declared stuck (its kernels'
# own deadlines, or gloo's, normally end it first and name the culprit).
GRACE_S = 5.0


@dataclass(eq=False)  # compared by identity: works in flight are many, and distinct
class _Watched:
    work: Work
    name: str
    deadline: float
    fail: Callable[[BaseException], None]  # the communicator's: broken, logged (or aborted)
    rank: int
    timeout: float
    # ``lost(name, where, started)`` gives the look for a lost peer (LostPeers.waiter); None off the workspace.
    lost: Callable[..., Callable[[], None]] | None = None
    look: Callable[[], None] | None = None  # made at the first poll that finds the work pending
    reported: bool = False  # a lost peer was reported: the work is held, its end not reported again


class _Watchdog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[Hashable, collections.deque[_Watched]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()  # of the running thread; each thread gets its own

    def watch(
        self,
        work: Work,
        name: str,
        timeout: float,
        fail: Callable[[BaseException], None],
        rank: int,
        queue: Hashable,
        lost: Callable[..., Callable[[], None]] | None = None,
    ) -> None:
        """:meth:`add` the work, and start the thread that polls if it is not running."""
        self.add(work, name, timeout, fail, rank, queue, lost)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop = threading.Event()
                self._thread = threading.Thread(
                    target=self._run, args=(self._stop,), name="gpucomm-watchdog", daemon=True
                )
                self._thread.start()

    def add(
        self,
        work: Work,
        name: str,
        timeout: float,
        fail: Callable[[BaseException], None],
        rank: int,
        queue: Hashable,
        lost: Callable[..., Callable[[], None]] | None = None,
    ) -> None:
        entry = _Watched(work, name, time.monotonic() + timeout + GRACE_S, fail, rank, timeout, lost)
        with self._lock:
            pending = self._queues.get(queue)
            if pending is None:
                pending = self._queues[queue] = collections.deque()
            pending.append(entry)

    def forget(self, queue: Hashable) -> None:
        """Stop watching the works of ``queue`` (its communicator is closed: they end with the
        close's error, and no communicator is left to tell)."""
        with self._lock:
            self._queues.pop(queue, None)

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    def stop(self) -> None:
        """End the thread and forget what it watched; a later :meth:`watch` starts a new one.

        Called when no communicator is open any more, or the process exits. Why at exit: a daemon thread
        still running when the interpreter finalises is ended where it next takes the GIL; inside a torch
        call (a gloo work's ``wait``) that is a C++ destructor, and the process aborts with "terminate
        called without an active exception".
        """
        with self._lock:
            thread, self._thread = self._thread, None
            self._queues = {}
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self, stop: threading.Event) -> None:
        enter_thread_local_capture_mode()  # before the first event query (module docstring)
        while not stop.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        """One look at every queue: drop its works that have ended, from the oldest on."""
        with self._lock:
            queues = list(self._queues.items())
        for key, pending in queues:
            while pending and self._ended(pending[0]):
                pending.popleft()
            if not pending:
                with self._lock:
                    if not pending and self._queues.get(key) is pending:
                        del self._queues[key]

    @staticmethod
    def _ended(w: _Watched) -> bool:
        if w.work.is_completed():
            error = w.work.exception()
            if error is not None and not w.reported:
                w.fail(error)
            return True
        if w.lost is not None and not w.reported:
            if w.look is None:  # the collective started when it was added: deadline - timeout - grace
                w.look = w.lost(w.name, "the watchdog", w.deadline - w.timeout - GRACE_S)
            try:
                w.look()
            except PeerLostError as err:
                w.reported = True
                w.fail(err)
        if time.monotonic() < w.deadline or w.reported:
            return False  # (a reported work is held until it ends: its kernel may still read its buffers)
        w.fail(
            CommTimeoutError(
                w.name,
                None,
                w.rank,
                [],
                w.timeout,
                detail=f"the collective had not ended {GRACE_S:g} s after its timeout",
            )
        )
        return True


_WATCHDOG = _Watchdog()


def watch(
    work: Work,
    name: str,
    timeout: float,
    fail: Callable[[BaseException], None],
    rank: int,
    queue: Hashable,
    lost: Callable[..., Callable[[], None]] | None = None,
) -> None:
    """Watch ``work`` until it ends; ``fail(error)`` if it fails or outlives ``timeout``.

    ``queue`` names the order the work completes in (works of one queue end oldest first: a
    CUDA stream, a gloo group, a progress thread); the watchdog looks only at the oldest pending
    work of each. ``lost(name, where, started)``: the look for a lost peer of a workspace
    collective (:meth:`gpucomm.reliability.lost.LostPeers.waiter`), None elsewhere.
    """
    _WATCHDOG.watch(work, name, timeout, fail, rank, queue, lost)


def forget(queue: Hashable) -> None:
    """Stop watching the works of ``queue`` (:meth:`_Watchdog.forget`)."""
    _WATCHDOG.forget(queue)


def stop() -> None:
    """End the watchdog's thread now (see :meth:`_Watchdog.stop`)."""
    _WATCHDOG.stop()
