"""``Progress``: the thread that runs a communicator's asynchronous collectives on the host workspace.

On the shared-memory workspace a collective is run by the host (:mod:`gpucomm.workspace.host_executor`):
copies, folds and flag waits in some thread. An ``async_op=True`` call must return at once
(DDP reduces its gradient buckets while the backward pass goes on), so such calls are queued
here and run, one after the other in call order, on one thread per communicator, started on the
first one. Every rank queues its collectives in the order it calls them, so the ranks' threads
run them in the same order, with the same programs, waits, timeouts and mismatch checks as a
blocking call.

A blocking call made while queued ones are pending goes through the same queue and waits for its
turn (:meth:`Progress.busy`), so that calls keep their order whatever mix of blocking and
asynchronous calls the caller makes; with nothing pending it runs in the caller's thread, with
no hand-over.

After a queued collective fails, the ones queued behind it are not run (their peers are in
another state by then): each ends with :class:`CommBrokenError` naming the first failure.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
from collections.abc import Callable

import torch

from gpucomm.errors import CommBrokenError, CommTimeoutError, GpucommError

__all__ = ["Progress", "Queued", "wait_gloo", "exiting"]

# Set once the process exits (gpucomm.comm.communicator.release_all): gpucomm's own threads stop
# waiting on gloo's works.
_EXITING = threading.Event()
_OWN = threading.local()  # ``polls`` is True in gpucomm's own threads (the progress threads)
# A wait on a queued collective that looks for lost peers (Queued's ``lost``) wakes this often to
# look; the looks themselves are rarer (gpucomm.reliability.lost: from 0.5 s into the wait, every
# 0.25 s), and the collective's end wakes it at once.
_LOOK_POLL_S = 0.05
# How a thread of gpucomm's own polls a gloo work: the first look after 20 us, then twice as long
# each time up to 0.5 ms (at most 0.5 ms late for a collective that runs longer; a 2-rank gloo
# all_reduce of 4 KiB takes about 100 us on the 2-core CI machine).
_FIRST_PAUSE_S = 2e-5
_MAX_PAUSE_S = 5e-4


def exiting() -> None:
    """The process exits: every wait of gpucomm's own threads on a gloo work ends now (it raises)."""
    _EXITING.set()


def wait_gloo(work: object, timeout: float | None = None) -> None:
    """Wait for the torch gloo ``work`` (``timeout`` in seconds, as its ``wait``); raise its error.

    In a caller's thread this is gloo's own ``wait``. gpucomm's own threads poll instead: a thread
    blocked inside gloo's ``wait`` when the interpreter finalises (a rank whose script ends with an
    asynchronous collective a peer never joins) is ended where it takes the GIL back, inside a C++
    destructor, and the process aborts ("terminate called without an active exception"). A
    polling thread sees :func:`exiting` and returns, so that the process's exit can join it first.
    """
    if getattr(_OWN, "polls", False):
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = _FIRST_PAUSE_S
        while not work.is_completed():  # type: ignore[attr-defined]
            if _EXITING.is_set():
                raise GpucommError("gpucomm: the process is exiting: the collective was left unfinished")
            if deadline is not None and time.monotonic() >= deadline:
                break  # gloo's wait raises its own timeout
            time.sleep(pause)
            pause = min(2 * pause, _MAX_PAUSE_S)
    if timeout is None:
        work.wait()  # type: ignore[attr-defined]
    else:
        work.wait(datetime.timedelta(seconds=timeout))  # type: ignore[attr-defined]


def _ran() -> None:
    """What a :class:`Queued` that has ended holds instead of its collective."""


class Queued:
    """One collective in a :class:`Progress` queue: the part of a :class:`gpucomm.work.Work` that
    ends when the progress thread has run it (``is_completed``, ``wait``, ``get_future``).

    Args:
        run: runs the collective (raises its error).
        name: the collective, for a wait's timeout message.
        rank: this rank, for a wait's timeout message.
        lost: ``lost(name, where)`` gives a wait's look at the peers' processes, which raises
            PeerLostError when one is gone (:meth:`gpucomm.reliability.lost.LostPeers.waiter`):
            a wait says so while the collective, stuck in a kernel on the progress thread, runs
            to its own deadline. None: the wait waits for the collective's end alone.
    """

    def __init__(
        self,
        run: Callable[[], object],
        name: str,
        rank: int,
        lost: Callable[[str, str], Callable[[], None]] | None = None,
    ) -> None:
        self.run = run
        self.name = name
        self.rank = rank
        self.lost = lost
        self._ended = threading.Event()
        self._error: BaseException | None = None
        self._future: torch.futures.Future = torch.futures.Future()

    def end(self, error: BaseException | None) -> None:
        """Called once by the progress thread when the collective has run (or failed), or by
        the close that dropped it. What it ran is dropped: a Work the caller keeps holds no
        workspace, path or buffer past its end."""
        self.run = _ran
        self._error = error
        self._ended.set()
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)

    def is_completed(self) -> bool:
        return self._ended.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the collective has run; raise its error. ``timeout`` (seconds) bounds
        this wait alone: the collective goes on (its own deadline is the communicator's)."""
        ended = self._ended.wait(timeout) if self.lost is None else self._wait_looking(timeout)
        if not ended:
            raise CommTimeoutError(
                self.name,
                None,
                self.rank,
                [],
                timeout,
                detail="the collective was still running on the progress thread",
            )
        if self._error is not None:
            raise self._error

    def _wait_looking(self, timeout: float | None) -> bool:
        """Wait for the end, for at most ``timeout`` seconds, looking at the peers now and then."""
        look = self.lost(self.name, "a collective run by the progress thread")  # type: ignore[misc]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pause = _LOOK_POLL_S if deadline is None else min(_LOOK_POLL_S, deadline - time.monotonic())
            if self._ended.wait(max(pause, 0.0)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            look()

    def get_future(self) -> torch.futures.Future:
        """A Future completed on the progress thread when the collective has run."""
        return self._future


class Progress:
    """The progress thread of one communicator (module docstring).

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: collections.deque[Queued] = collections.deque()
        self._running = False  # the thread is running a collective now
        # Collectives submitted that have not ended: raised by the submitting thread, lowered by
        # the progress thread once one has ended, so that 0 (read without the lock: one int)
        # means every collective queued so far has ended (idle(), the fast path's check).
        self._outstanding = 0
        self._failure: BaseException | None = None  # the first collective that failed
        self._closing = False
        self._thread: threading.Thread | None = None

    def busy(self) -> bool:
        """Whether a queued collective has not ended yet, so that a new call must queue behind
        it. False on the progress thread itself (a Future's callback that calls a collective runs
        it there and then, at the same point on every rank: queueing it would wait on itself)."""
        if threading.current_thread() is self._thread:
            return False
        with self._cond:
            return self._running or bool(self._queue)

    def idle(self) -> bool:
        """Whether every collective queued so far has ended, without taking the lock (False on
        the progress thread while it runs one: the caller then asks :meth:`busy`)."""
        return self._outstanding == 0

    def drain(self) -> None:
        """Wait until every queued collective has ended (send/recv share the mailboxes with
        the collectives' waits, so they start only then)."""
        if threading.current_thread() is self._thread:
            return
        with self._cond:
            self._cond.wait_for(lambda: not self._running and not self._queue)

    def submit(self, queued: Queued) -> Queued:
        """Queue ``queued`` behind every collective queued before it; return it."""
        with self._cond:
            if self._closing:
                raise GpucommError(f"gpucomm.{queued.name}: the communicator is being closed")
            self._queue.append(queued)
            self._outstanding += 1
            if self._thread is None:
                # A daemon: a process that exits without destroying its groups is not held up by
                # it (release_all stops it first).
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return queued

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Stop taking collectives; with ``wait``, let the one running end (its waits have a
        deadline) and end the rest with an error, then join the thread (for at most ``timeout``
        seconds, if given). Idempotent."""
        with self._cond:
            self._closing = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cond.notify()
            thread = self._thread
        for queued in dropped:
            queued.end(GpucommError(f"gpucomm.{queued.name}: the communicator was closed before this collective ran"))
        with self._cond:
            self._outstanding -= len(dropped)
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _loop(self) -> None:
        _OWN.polls = True  # its waits on gloo end when the process exits (wait_gloo)
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                queued = self._queue.popleft()
                self._running = True
            error: BaseException | None = None
            try:
                if self._failure is not None:
                    raise CommBrokenError(
                        f"gpucomm.{queued.name}: not run: an asynchronous collective queued before it failed "
                        f"(original error: {self._failure})"
                    )
                with torch.no_grad():  # as the caller's thread runs it (gpucomm.comm.route)
                    queued.run()
            except Exception as err:  # noqa: BLE001 - handed to the Work, which raises it in wait()
                error = err
                if self._failure is None:
                    self._failure = err
            # The collective has ended: say so before its Work is told, so that the caller's next
            # call, made the moment its wait returns, finds this thread idle (a blocking call's
            # launch is learned by the repeat cache only then: gpucomm.comm.collectives).
            with self._cond:
                self._running = False
                self._outstanding -= 1
                self._cond.notify_all()
            queued.end(error)  # the Future's callbacks run here, before the next collective
