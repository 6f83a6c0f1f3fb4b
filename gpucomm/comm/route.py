"""The route of one call: from a validated :class:`~gpucomm.comm.call.Call` to its path and Work.

:meth:`Router.route` takes a few named steps: number the call, choose its path (the workspace
engine with an algorithm, gloo checked, or gloo), say it in the log and check it against a CUDA
graph capture, record it in the flight record, start it where it runs (the caller's CUDA stream,
the engine's, the progress thread, or this thread), build its :class:`~gpucomm.work.Work`, hand
it to the watchdog, and wait for it unless the caller asked for the Work.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

import torch

from gpucomm import log
from gpucomm.capture import capturing
from gpucomm.comm.call import POINT_TO_POINT, UNEVEN_SIZES, Call
from gpucomm.comm.path import Path
from gpucomm.config import Config
from gpucomm.errors import (
    CommBrokenError,
    CommMismatchError,
    CommTimeoutError,
    GpucommError,
    PeerLostError,
    UnsupportedError,
)
from gpucomm.gloo.fallback import GlooFallback
from gpucomm.progress import Progress, Queued
from gpucomm.reliability.flight import FlightLog
from gpucomm.reliability.liveness import Liveness
from gpucomm.reliability.story import mismatch_story, timeout_story
from gpucomm.reliability.watchdog import watch
from gpucomm.work import StreamEnd, Work
from gpucomm.workspace.engine import Engine
from gpucomm.workspace.path import EnginePath

__all__ = ["Router"]

# How gloo words a peer that died or never came: "Timed out waiting ...", "Connection closed by
# peer", "Connection reset by peer", "Socket closed", "Broken pipe".
_GLOO_PEER_FAILURES = (
    "imed out",
    "onnection closed",
    "onnection reset",
    "ocket closed",
    "roken pipe",
    "Read error",
    "Write error",
)


class Router:
    """The route of a call, for :class:`gpucomm.comm.communicator.Communicator` (its base)."""

    # What the route reads and writes of the communicator (set by its constructor).
    rank: int
    global_ranks: list[int]
    config: Config
    timeout: float
    _calls: int  # collective calls so far: equal on all ranks for the same call
    _broken: BaseException | None
    _closed: bool
    _engines: dict[str, Engine]
    _fallback: GlooFallback
    _progress: Progress
    _flight: FlightLog
    _liveness: Liveness
    # One call at a time, in the order this rank's threads take it (docs/reliability.md, "Threads"):
    # re-entrant, as all_reduce takes it around its repeat lookup and then routes.
    _lock: threading.RLock

    def _check_usable(self, fn: str) -> None:
        """Raise where no call may start: the communicator is closed, or broken by a failure."""
        if self._closed:
            raise GpucommError(f"gpucomm.{fn}: this communicator is closed")
        if self._broken is not None:
            raise CommBrokenError(
                f"gpucomm.{fn}: the communicator failed earlier and cannot be used until it is destroyed "
                f"(original error: {self._broken})"
            ) from self._broken

    def _route(self, call: Call) -> Work | None:
        """Route one validated call to a path, check that all ranks agree on it, log it, run it.

        Returns the call's Work where ``call.async_op``, else None once it has run (on a GPU:
        once it is queued on the caller's stream). Raises the path's failure as gpucomm's error
        (:meth:`_translate`), which breaks the communicator.

        Calls from several threads run one at a time, each whole (a blocking one until it has
        run), in the order the threads enter: the order each rank issues them, as torch's
        process groups serialise them.
        """
        with self._lock:
            started = time.monotonic()
            seq = self._number(call)
            translate = self._translate(call.fn, seq, call.peer)
            engine, algo = self._choose(call)
            self._announce(call, engine, algo)
            # An asynchronous call that would wait in the caller's thread (the host workspace runs it
            # there; a checked gloo call agrees on fingerprints before gloo's collective may start),
            # or any call behind one, runs on the progress thread, in call order.
            host = algo is not None and engine.stream is None
            waits = host or (algo is None and self.config.check != "off")
            queued = waits and not call.point_to_point and (call.async_op or self._progress.busy())
            if host and call.point_to_point:
                self._progress.drain()
            slot = self._flight.entered(seq, call.fn, call.tensor, call.fields)  # type: ignore[arg-type]
            on_gpu = algo is not None and engine.stream is not None
            # On the workspace, a queued or asynchronous call's waits look for lost peers
            # (gpucomm.reliability.lost); a blocking one's do in the executor, or not at all.
            lost = engine.lost.waiter if algo is not None and (queued or call.async_op) else None
            debug = log.logger.isEnabledFor(logging.DEBUG)
            if debug:
                log.logger.debug(_stages(self.rank, call, seq, algo, on_gpu, queued, self.config.check))
            try:
                # Outside autograd, as torch's process groups write: a tensor that requires grad (an
                # nn.Parameter) is written in place on its data (so are the finish steps: gpucomm.work).
                with torch.no_grad():
                    path = self._path(call, seq, engine, algo)
                    if on_gpu:
                        pending = self._on_gpu(call, engine, path)
                    elif queued:  # on the progress thread, in call order (gpucomm.progress)
                        pending = [
                            self._progress.submit(
                                Queued(
                                    functools.partial(_to_end, call.serve, path),
                                    call.fn,
                                    self.rank,
                                    lost=lost,  # a wait on it says a lost peer while a kernel runs on
                                )
                            )
                        ]
                    else:
                        # gloo's works run on gloo's threads (a checked call's fingerprints travel in its
                        # first exchange: gpucomm.gloo.checked); the host workspace runs in this thread
                        # (a collective has run on return, send/recv progress in wait()).
                        pending = [call.serve(path)]
            except RuntimeError as err:
                raise translate(err) from err
            work = Work(
                pending,
                None if on_gpu else call.finish,  # on a GPU the write-back is queued after the collective
                translate,
                outputs=call.outputs,
                blocking=call.blocking or self.config.blocking_wait,
                keep=(call,),  # what the collective's buffers hang on, until it is complete
                side_stream=engine.side_stream if on_gpu and call.async_op else None,
            )
            self._watch(call, work, engine if on_gpu else None, algo, queued, lost)
            if call.async_op:
                self._flight.completes_with(slot, work)
                return work
            work.wait()
            self._flight.completed(slot)
            if debug:
                took = (time.monotonic() - started) * 1e3
                log.logger.debug(f"gpucomm DEBUG [rank {self.rank}] {call.fn} call {seq}: returned after {took:.3f} ms")
            return None

    # -- the steps ----------------------------------------------------------------------------
    def _number(self, call: Call) -> int:
        """The call's number: collectives count, a send or recv takes the last one's."""
        if not call.point_to_point:
            self._calls += 1
        return self._calls

    def _choose(self, call: Call) -> tuple[Engine | None, str | None]:
        """The workspace engine of the call's tensors and the algorithm it runs the call with;
        (engine or None, None) where gloo serves the call."""
        tensor = call.tensor
        # A barrier has no tensor: it waits on the host's workspace where there is one, so that it
        # returns once every rank has arrived, as torch.distributed's does.
        engine = self._engines.get("cpu" if tensor is None else tensor.device.type)
        if engine is None and tensor is None and self._engines:
            engine = next(iter(self._engines.values()))
        algo = engine.serves(call.fn, tensor) if engine is not None else None
        return engine, algo

    def _announce(self, call: Call, engine: Engine | None, algo: str | None) -> None:
        """Log the call (GPUCOMM_DEBUG=INFO) and refuse one a CUDA graph cannot capture."""
        if log.logger.isEnabledFor(logging.INFO):
            detail = {"path": "gloo"} if algo is None else {"path": "workspace", **engine.describe(algo)}
            log.logger.info(log.describe_call(self.rank, call.fn, call.tensor, **call.fields, **detail))
        if call.tensor is not None and capturing(call.tensor.device):
            _check_capturable(call.fn, engine, algo)

    def _path(self, call: Call, seq: int, engine: Engine | None, algo: str | None) -> Path:
        """The path that serves the call: the engine with its algorithm, else gloo, checked
        (GPUCOMM_CHECK) for a collective."""
        if algo is not None:
            return EnginePath(engine, algo, call.fields.get("user_dtype"))  # type: ignore[arg-type]
        if not call.point_to_point and self.config.check != "off":
            return self._fallback.checked(call.fingerprint(), self._describe(call, seq))
        return self._fallback

    def _on_gpu(self, call: Call, engine: Engine, path: Path) -> list[object]:
        """Queue the call on a CUDA stream, its write-back after it there; what its Work waits
        for. A blocking call goes on the caller's current stream, an asynchronous one on the
        engine's (gpucomm.workspace.stream_order keeps them in call order)."""
        if call.async_op:
            return self._on_stream(call, engine, path)
        return self._on_caller_stream(call, engine, path)

    def _on_stream(self, call: Call, engine: Engine, path: Path) -> list[object]:
        """Queue a collective on the engine's CUDA stream, after the caller's stream and this
        communicator's launches so far; returns what its Work waits for: the path's Work and the
        event recorded after the collective (and after its write-back, when it has one)."""
        with engine.on_stream():
            inner = call.serve(path)
            if call.finish is not None:
                call.finish()
            end = torch.cuda.Event()
            end.record(engine.stream)
        return [inner, StreamEnd(end, engine.stream, engine.executor.check, call.fn, self.rank, engine.lost.waiter)]

    def _on_caller_stream(self, call: Call, engine: Engine, path: Path) -> list[object]:
        """Queue a blocking collective on the caller's current stream, after this communicator's
        launches so far, and its write-back after it there; the host goes on at once. Returns
        what its Work waits for.

        No end event, no watchdog: a kernel's error record is raised by the communicator's next
        call (every launch looks first), ``check()`` or a later Work's wait. With
        GPUCOMM_BLOCKING_WAIT=1 an end event lets the host wait for the collective here."""
        engine.on_caller_stream()
        inner = call.serve(path)
        if call.finish is not None:
            call.finish()
        if not self.config.blocking_wait or capturing(engine.device):
            return [inner]
        stream = torch.cuda.current_stream(engine.device)
        end = torch.cuda.Event()
        end.record(stream)
        return [inner, StreamEnd(end, stream, engine.executor.check, call.fn, self.rank, engine.lost.waiter)]

    def _watch(
        self,
        call: Call,
        work: Work,
        stream_engine: Engine | None,
        algo: str | None,
        queued: bool,
        lost: Callable[..., Callable[[], None]] | None,
    ) -> None:
        """Hand an asynchronous call's Work to the watchdog, with the queue whose order it ends
        in: the engine's stream (``stream_engine``), the progress thread's, a gloo group's; and,
        on the workspace, the look for a lost peer (``lost``: gpucomm.reliability.lost)."""
        on_stream = stream_engine is not None and call.async_op
        if (on_stream and not capturing(stream_engine.device)) or (call.async_op and (algo is None or queued)):
            queue = stream_engine if on_stream else self._progress if queued else self._fallback
            watch(work, call.fn, self.timeout, self._fail, self.rank, queue=queue, lost=lost)

    # -- failures -----------------------------------------------------------------------------
    def _translate(self, fn: str, seq: int, peer: int | None) -> Callable[[RuntimeError], BaseException]:
        """Turn a failure of call ``seq`` into gpucomm's error, and mark the communicator broken.

        The function holds the communicator weakly: a Work the caller keeps past
        ``destroy_process_group`` keeps nothing of it alive. A failure seen once the communicator
        is closed (or gone) is the close's doing: it is told as such, and nothing of the closed
        communicator (its flight record, its peers) is asked."""
        owner = weakref.ref(self)
        started = time.monotonic()  # a peer lost is told with how far into the call it went

        def translate(err: RuntimeError) -> BaseException:
            if isinstance(err, UnsupportedError):
                return err  # raised before anything moved (a call that cannot be captured yet)
            comm = owner()
            if comm is None or comm._closed:
                return _closed_error(fn, err)
            if isinstance(err, GpucommError):
                if isinstance(err, PeerLostError) and err.seen_at - started - err.elapsed >= 0.05:
                    err = err.counted_from(started)  # the wait that saw it began after the call did
                comm._flight.failed(seq)
                comm._tell(err, seq)
                comm._broken = err
                return err
            text = str(err)
            if not any(sign in text for sign in _GLOO_PEER_FAILURES):
                return err
            # Stamped first: a peer still naming culprits reads that this rank failed, and does
            # not name it if it exits before they are done (gpucomm.reliability.liveness).
            comm._flight.failed(seq)
            record = comm._flight.record
            missing = (
                [peer]
                if peer is not None
                else comm._liveness.culprits(seq, failed_first=lambda r: record.failed_last(comm.global_ranks[r]))
            )
            failure = _failure(comm, fn, seq, missing, text.splitlines()[0], time.monotonic() - started)
            comm._tell(failure, seq)
            comm._broken = failure
            return failure

        return translate

    def _tell(self, err: GpucommError, seq: int) -> None:
        """Add what the ranks involved are doing, from the node's flight records, to ``err``."""
        if isinstance(err, CommTimeoutError) and err.missing:
            err.tell(timeout_story(self._flight, self, err.missing))
        elif isinstance(err, CommMismatchError) and err.peers:
            err.tell(mismatch_story(self._flight, self, seq, err.peers))

    def _describe(self, call: Call, seq: int) -> Callable[[list[int]], str]:
        """The words of a gloo-path mismatch of call ``seq``, given the ranks that called something else.
        It holds the communicator weakly, as :meth:`_translate` does (a failed call's traceback
        keeps its path, and the path this function)."""
        fn, tensor, rank, owner = call.fn, call.tensor, self.rank, weakref.ref(self)

        def describe(differ: list[int]) -> str:
            options = ", ".join(f"{k}={v}" for k, v in call.fields.items()) or "no options"
            size = "" if tensor is None else f", {tensor.numel()} x {tensor.dtype}"
            comm = owner()
            story = "" if comm is None or comm._closed else mismatch_story(comm._flight, comm, seq, differ)
            return (
                f"gpucomm.{fn} call {seq}: rank {rank} called {fn} with {options}{size}, but rank(s) {differ} "
                f"called something else (a different collective, size, dtype, op or root)\n" + story
            )

        return describe

    def _fail(self, error: BaseException) -> None:
        """The watchdog found ``error``: the communicator is broken from now on; one line says
        why; with GPUCOMM_ASYNC_ERROR_HANDLING=abort the process ends here."""
        if self._closed:
            return  # a collective cut short by destroy_process_group is no news
        if isinstance(error, PeerLostError):
            # The newest call stamped failed, as a wait's error stamps its own, before anyone can
            # see the communicator broken and exit: a slower survivor then does not name this rank
            # once it has (gpucomm.reliability.liveness.Liveness.lost).
            self._flight.failed(self._calls)
        if self._broken is None:
            self._broken = error
        log.logger.error(f"gpucomm[rank {self.rank}]: watchdog: {error}")
        if self.config.async_error_handling == "abort":
            logging.shutdown()
            os.abort()


def _closed_error(fn: str, err: RuntimeError) -> GpucommError:
    """The error of a collective cut short by its communicator's close: the error recorded for it
    where it is gpucomm's (a queued call dropped, a timeout), else one saying so."""
    if isinstance(err, GpucommError):
        return err
    return GpucommError(
        f"gpucomm.{fn}: the communicator was closed before this collective ended ({str(err).splitlines()[0]})"
    )


def _stages(rank: int, call: Call, seq: int, algo: str | None, on_gpu: bool, queued: bool, check: str) -> str:
    """GPUCOMM_DEBUG=DEBUG: where call ``seq`` runs and how, beyond the INFO line's path."""
    if algo is not None:
        where = (
            ("the engine's CUDA stream" if call.async_op else "the caller's CUDA stream")
            if on_gpu
            else ("the progress thread" if queued else "the calling thread")
        )
        how = f"workspace program {algo}"
    else:
        checked = not call.point_to_point and check != "off"
        where = "the progress thread" if queued else "gloo's threads"
        how = f"gloo, fingerprints compared first (GPUCOMM_CHECK={check})" if checked else "gloo, unchecked"
    mode = "async_op=True" if call.async_op else "blocking"
    return f"gpucomm DEBUG [rank {rank}] {call.fn} call {seq}: {mode}, {how}, runs on {where}"


def _failure(comm: Router, fn: str, seq: int, missing: list[int], said: str, elapsed: float) -> CommTimeoutError:
    """gloo's failure of call ``seq`` as gpucomm's: a peer whose process is gone, or whose
    connection closed before the timeout, is lost (:class:`PeerLostError`); else a timeout."""
    crashed = bool(missing) and all(comm._liveness.gone(r) for r in missing)
    if crashed or (missing and "imed out" not in said and elapsed < comm.timeout):
        return PeerLostError(
            fn, seq, comm.rank, missing, comm.timeout, elapsed, crashed=crashed, detail=f"gloo: {said}"
        )
    return CommTimeoutError(fn, seq, comm.rank, missing, comm.timeout, detail=f"gloo: {said}")


def _check_capturable(fn: str, engine: Engine | None, algo: str | None) -> None:
    """A collective captured into a CUDA graph must run entirely on the device."""
    reason = None
    if algo is None:
        reason = "it is served by gloo here"
    elif engine.kernels.name == "torch":
        reason = "the torch kernels wait on the host (use GPUCOMM_KERNELS=triton or cuda)"
    elif fn in POINT_TO_POINT or fn in UNEVEN_SIZES or algo == "hierarchical":
        reason = "its schedule is decided on the host between launches"
    if reason is not None:
        raise UnsupportedError(f"gpucomm.{fn}: cannot be captured in a CUDA graph: {reason}")


def _to_end(serve: Callable[[Path], Work], path: Path) -> None:
    """Run a call on ``path`` and wait for its end (on the progress thread)."""
    serve(path).wait()
