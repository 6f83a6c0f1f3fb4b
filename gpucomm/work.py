"""``Work``: the handle of one collective, with torch.distributed's semantics.

How a Work completes depends on the path that served the collective:

- **in the caller's thread** (a blocking call on the shared-memory workspace, the Triton
  interpreter): the collective has run when the call returns; the Work is complete from the start.
- **the communicator's progress thread** (an ``async_op=True`` call on the shared-memory
  workspace, and any call behind one: :mod:`gpucomm.progress`): the call returns at once; the
  Work completes when the thread has run it, and then runs its ``finish`` step once; ``wait()``
  blocks the host, ``get_future()`` completes on the progress thread.
- **gloo**: torch's gloo works run on gloo's threads; the Work completes once they have, and then
  runs its ``finish`` step once (a check, the write-back of a staged result). ``wait()`` blocks
  the host, as gloo's does; ``get_future()`` completes on gloo's thread without anyone waiting.
- **a communicator's CUDA stream** (:class:`StreamEnd`): the kernels were queued on the
  communicator's stream, after the caller's stream, and an end event recorded. ``wait()`` orders
  the caller's current stream after that event and returns at once, as NCCL's does; with a
  ``timeout`` (or ``GPUCOMM_BLOCKING_WAIT=1``) it blocks the host until the event has passed.
  ``is_completed()`` asks the event, never waiting. Errors recorded by the kernels surface here,
  at the communicator's next call, or from the watchdog (:mod:`gpucomm.reliability.watchdog`).

A Work keeps what its collective uses (``keep``) until it is complete, and the watchdog keeps
pending Works, so that no buffer a kernel still reads goes back to the allocator early.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Sequence

import torch

from gpucomm.config import check_timeout
from gpucomm.errors import CommTimeoutError
from gpucomm.progress import Queued, wait_gloo

__all__ = ["Work", "StreamEnd", "WaitedInThread"]

# A blocking wait on a GPU collective looks at its end event this often.
_POLL_S = 1e-4
_ZERO = datetime.timedelta(0)  # torch's Work.wait passes it (its kNoTimeout) for "no timeout of its own"


class StreamEnd:
    """The end of a collective queued on a communicator's CUDA stream.

    Args:
        event: recorded on the stream after the collective (and its finish step).
        stream: the communicator's stream.
        check: raises the error a kernel recorded, if any (never waits for the device).
        describe: the collective's name, for a timeout's message.
        rank: this rank, for a timeout's message.
        lost: ``lost(describe, where)`` gives a blocking wait's look at the peers' processes,
            which raises PeerLostError when one is gone (gpucomm.reliability.lost): the host says
            so while the kernel, which cannot be interrupted, runs to its own deadline.
    """

    def __init__(
        self,
        event: torch.cuda.Event,
        stream: torch.cuda.Stream,
        check: Callable[[], None],
        describe: str,
        rank: int,
        lost: Callable[[str, str], Callable[[], None]] | None = None,
    ) -> None:
        self.event = event
        self.stream = stream
        self.check = check
        self.describe = describe
        self.rank = rank
        self.lost = lost

    def is_completed(self) -> bool:
        self.check()
        return self.event.query()

    def wait(self, block: bool = False, timeout: float | None = None) -> None:
        """Order the caller's current stream after the collective; with ``block``, also wait on the
        host, raising :class:`CommTimeoutError` once ``timeout`` seconds (if given) have passed."""
        self.check()
        torch.cuda.current_stream(self.stream.device).wait_event(self.event)
        if not block:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        look = None if self.lost is None else self.lost(self.describe, "a blocking wait on the collective's end")
        while not self.event.query():
            self.check()
            if look is not None:
                look()
            if deadline is not None and time.monotonic() >= deadline:
                raise CommTimeoutError(
                    self.describe,
                    None,
                    self.rank,
                    [],
                    timeout,
                    detail="the collective did not finish within the wait's timeout",
                )
            time.sleep(_POLL_S)
        self.check()

    def future(self, outputs: list[torch.Tensor], side: torch.cuda.Stream) -> torch.futures.Future:
        """A CUDA-aware Future of ``outputs``: a stream that waits on it is ordered after this
        collective (``side`` waits for the end event, so later collectives do not delay it)."""
        future: torch.futures.Future = torch.futures.Future(devices=[self.stream.device])
        with torch.cuda.stream(side):
            side.wait_event(self.event)
            future.set_result(outputs)
        return future


class WaitedInThread:
    """A gloo work that neither reports its completion nor has a Future (gloo's reduce_scatter,
    measured on torch 2.13: ``is_completed()`` stays False after ``wait()``): a thread of its own
    waits on it, so that it completes in the background like every other gloo work."""

    def __init__(self, work: torch.distributed.Work) -> None:
        self._work = work
        self._ended = threading.Event()
        self._error: RuntimeError | None = None
        self._future: torch.futures.Future = torch.futures.Future()
        threading.Thread(target=self._wait, name="gpucomm-gloo-wait", daemon=True).start()

    def _wait(self) -> None:
        try:
            self._work.wait()
            self._future.set_result(None)
        except RuntimeError as err:
            self._error = err
            self._future.set_exception(err)
        self._ended.set()

    def is_completed(self) -> bool:
        return self._ended.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._ended.wait(timeout):
            raise RuntimeError(f"Timed out waiting {timeout} s for the gloo work to finish")
        if self._error is not None:
            raise self._error

    def get_future(self) -> torch.futures.Future:
        return self._future


class Work:
    """Completion handle of one collective (see the module docstring).

    Everything a Work knows is given to its constructor; nothing outside sets its state.

    Args:
        pending: what must complete first: torch.distributed Works (gloo), :class:`StreamEnd`, or
            objects with ``is_completed()`` and ``wait()`` (send/recv's requests, other Works).
        finish: runs once, after ``pending`` completed, on the host.
        on_error: turns a failure into gpucomm's error (and marks the communicator broken).
        outputs: the caller's output tensors, which :meth:`result` returns.
        blocking: ``wait()`` blocks the host on a GPU too (GPUCOMM_BLOCKING_WAIT, a barrier).
        keep: what the collective's buffers hang on, held until it is complete.
        side_stream: where a GPU Future is completed (None off a GPU).
        source: the sender's rank of a recv, where it is known at the start.
    """

    def __init__(
        self,
        pending: Sequence[object] = (),
        finish: Callable[[], None] | None = None,
        on_error: Callable[[RuntimeError], BaseException] | None = None,
        *,
        outputs: Sequence[torch.Tensor] = (),
        blocking: bool = False,
        keep: tuple = (),
        side_stream: torch.cuda.Stream | None = None,
        source: int | None = None,
    ) -> None:
        self._pending = [_tracked(p) for p in pending]
        self._finish = finish
        self._on_error = on_error
        self._finished = not self._pending and finish is None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._fail_lock = threading.Lock()  # one translation of a failure (it may ask the peers)
        self._keep = keep
        self._source = source
        self.blocking = blocking
        self.side_stream = side_stream
        self.outputs: list[torch.Tensor] = list(outputs)
        self.waiters: list[torch.futures.Future] = []  # Futures to complete when this work does

    @property
    def source(self) -> int | None:
        """The sender's rank, for a completed recv: given at the start, learned by the finish
        step of an any-source recv, or that of the Work this one waited on."""
        if self._source is None:
            for p in self._pending:
                if isinstance(p, Work) and p.source is not None:
                    return p.source
        return self._source

    @source.setter
    def source(self, rank: int | None) -> None:
        # Set by a recv's own finish step, once the sender is known.
        self._source = rank

    # -- torch.distributed.Work ---------------------------------------------------------------
    def is_completed(self) -> bool:
        """Whether the collective has ended (successfully or not); never waits."""
        if self._error is not None or self._finished:
            return True
        try:
            if not all(p.is_completed() for p in self._pending):  # type: ignore[attr-defined]
                return False
            for p in self._pending:
                if not isinstance(p, StreamEnd):  # (a StreamEnd's errors come from its check)
                    _wait_one(p, False, None)  # it has ended: this raises its error, if any
            self._run_finish()
        except RuntimeError as err:
            self._fail(err)
            return True
        self._keep = ()
        return True

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def wait(self, timeout: object = None) -> bool:
        """Wait for the collective (module docstring); raises its error, translated.

        ``timeout``: a timedelta or seconds; None, or zero (torch's ``kNoTimeout``), waits for
        as long as the communicator's own timeout. Anything else must be a positive, finite
        number of seconds (ValueError otherwise, :func:`gpucomm.config.check_timeout`)."""
        seconds = None if timeout is None or timeout == 0 or timeout == _ZERO else check_timeout(timeout, "Work.wait")
        if self._error is not None:
            raise self._error
        block = self.blocking or seconds is not None
        try:
            for p in self._pending:
                _wait_one(p, block, seconds)
            self._run_finish()
        except RuntimeError as err:
            error = self._fail(err)
            if seconds is not None and isinstance(error, CommTimeoutError) and error.timeout != seconds:
                # The wait's own timeout ran out, not the communicator's: say so.
                error = CommTimeoutError(
                    error.op, error.epoch, error.rank, error.missing, seconds, detail="the timeout given to Work.wait()"
                )
            raise error from err
        return True

    def result(self) -> list[torch.Tensor]:
        """The output tensors of the collective, once it is complete (waits for it)."""
        self.wait()
        return list(self.outputs)

    def exception(self) -> BaseException | None:
        """The error the collective ended with, or None (so far, or because it succeeded)."""
        return self._error

    def get_future(self) -> torch.futures.Future:
        """A Future of :meth:`result`, completed when the collective is, without anyone waiting:
        on gloo's thread for gloo works, in stream order (a CUDA-aware Future) on a GPU, at once
        for a collective that already ran. A failure is set on the Future, not raised here."""
        ends = [p for p in self._pending if isinstance(p, StreamEnd)]
        if ends and self.side_stream is not None:
            return ends[-1].future(self.outputs, self.side_stream)
        futures = _futures_of(self._pending)
        if futures:
            return torch.futures.collect_all(futures).then(self._future_result)
        future: torch.futures.Future = torch.futures.Future()
        if self.is_completed():
            _settle(future, self._error, self.outputs)
        else:
            # send/recv on the workspace progress only inside waits: whoever sees this work end
            # (wait(), is_completed()) completes the Future.
            with self._lock:
                self.waiters.append(future)
        return future

    # -- internals ----------------------------------------------------------------------------
    def _future_result(self, collected: torch.futures.Future) -> list[torch.Tensor]:
        try:
            for done in collected.value():
                done.value()  # raises the gloo work's error
            self._run_finish()
        except RuntimeError as err:
            raise self._fail(err) from err
        return list(self.outputs)

    def _run_finish(self) -> None:
        with self._lock:  # gloo's thread (a Future's callback) and the caller may both get here
            if self._finished:
                return
            finish, self._finish = self._finish, None
            if finish is not None:
                # Outside autograd whatever thread gets here: the write-back of a staged result
                # into an nn.Parameter is an in-place write on its data, as torch's gloo makes.
                with torch.no_grad():
                    finish()
            self._finished = True
            waiters, self.waiters = self.waiters, []
        for future in waiters:
            _settle(future, None, self.outputs)

    def _fail(self, err: RuntimeError) -> BaseException:
        with self._fail_lock:  # the caller and the watchdog may both see the failure
            if self._error is None:
                self._error = err if self._on_error is None else self._on_error(err)
        self._keep = ()
        self._finish = None  # never runs now: what it would write back is let go
        with self._lock:
            waiters, self.waiters = self.waiters, []
        for future in waiters:
            _settle(future, self._error, self.outputs)
        return self._error


def _tracked(pending: object) -> object:
    """``pending``, or a :class:`WaitedInThread` for a gloo work that cannot report its end."""
    if isinstance(pending, torch.distributed.Work):
        try:
            pending.get_future()
        except RuntimeError:  # "Work::getFuture not implemented"
            return WaitedInThread(pending)
    return pending


def _futures_of(pending: Sequence[object]) -> list[torch.futures.Future]:
    """The Futures of every pending part, or [] if one of them has none."""
    futures = []
    for p in pending:
        try:
            futures.append(p.get_future())  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):  # gloo's "Work::getFuture not implemented"
            return []
    return futures


def _settle(future: torch.futures.Future, error: BaseException | None, outputs: list[torch.Tensor]) -> None:
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(list(outputs))


def _wait_one(pending: object, block: bool, timeout: float | None) -> None:
    if isinstance(pending, StreamEnd):
        pending.wait(block, timeout)
    elif isinstance(pending, (WaitedInThread, Work, Queued)):
        pending.wait(timeout)
    elif isinstance(pending, torch.distributed.Work):
        wait_gloo(pending, timeout)
    else:
        pending.wait()  # type: ignore[attr-defined]
