"""The torch ``Work`` that a gpucomm process group's calls return, made from gpucomm's Works.

Every collective is started asynchronously; its torch Work completes with the Future of
gpucomm's Work (gpucomm.work): completed on gloo's thread when gloo finishes, in
stream order on a GPU (a CUDA-aware Future on the communicator's stream), on the communicator's
progress thread on the shared-memory workspace (gpucomm.progress). So DDP's buckets reduce
while its backward pass goes on. Point-to-point calls return at once with a :class:`P2PWork`
whose ``wait()`` completes them, so that any legal pattern of ``isend``/``irecv`` (rings, both
directions, ``batch_isend_irecv``) completes.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from gpucomm.errors import CommTimeoutError, PeerLostError
from gpucomm.work import Work

__all__ = ["BarrierWork", "P2PWork", "PendingWork", "pending"]


class BarrierWork(dist.Work):
    """A barrier in flight, whose ``wait()`` raises as gloo's does once the group's timeout has
    passed (torch's ``test_barrier_timeout_full_group``: a message matching
    ``" (Timed out|closed|timeout) "``). A Work made by ``_create_work_from_future`` would not:
    its ``wait()`` returns True even when the Future holds an error (torch 2.13)."""

    def __init__(self, work: Work) -> None:
        super().__init__()
        self._work = work

    def wait(self, timeout: object = None) -> bool:
        try:
            self._work.wait(_no_timeout_as_none(timeout))
        except PeerLostError:
            raise  # a peer gone is no timeout: said as such (gpucomm.errors.PeerLostError)
        except CommTimeoutError as err:
            # gloo's words ("Timed out waiting 1000ms for recv operation to complete"), which
            # torch's tests and its users' scripts match, beside gpucomm's own.
            detail = f"Timed out waiting {err.timeout * 1e3:.0f}ms for the barrier"
            raise CommTimeoutError(err.op, err.epoch, err.rank, err.missing, err.timeout, detail=detail) from err
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future()


class P2PWork(dist.Work):
    """A send or receive in flight: ``wait()`` drives it to completion (and raises its error);
    ``torch.distributed.recv`` from any source asks it ``_source_rank()`` afterwards."""

    def __init__(self, work: Work, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._work = work
        self._tensors = tensors
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: object = None) -> bool:
        self._work.wait()
        if self._future is not None and not self._future.done():
            self._future.set_result(self._tensors)
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self.is_completed()

    def get_future(self) -> torch.futures.Future:
        """A Future completed by ``wait()`` (gpucomm's point-to-point calls progress inside waits)."""
        if self._future is None:
            self._future = _future(self._tensors) if self._work.is_completed() else torch.futures.Future()
        return self._future

    def _source_rank(self) -> int:
        self.wait()
        return self._work.source  # type: ignore[return-value]


def _future(tensors: list[torch.Tensor]) -> torch.futures.Future:
    """A Future already holding ``tensors``; on CUDA it records the current streams, so that
    whoever waits on it is ordered after the kernels the collective queued there."""
    devices = sorted({t.device for t in tensors if t.is_cuda}, key=str)
    fut: torch.futures.Future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
    fut.set_result(tensors)
    return fut


def _done(tensors: list[torch.Tensor]) -> dist.Work:
    return _create_work_from_future(_future(tensors))


def _no_timeout_as_none(timeout: object) -> object:
    """torch's ``Work.wait()`` passes ``timedelta(0)`` (its ``kNoTimeout``) for "no timeout"."""
    if isinstance(timeout, datetime.timedelta) and timeout == datetime.timedelta(0):
        return None
    return timeout


def pending(works: Sequence[Work | None], tensors: list[torch.Tensor]) -> dist.Work:
    """The torch Work of gpucomm Works in flight (:class:`PendingWork`), or of a collective
    that already ran in full (sparse all_reduce)."""
    works = [w for w in works if w is not None]
    return PendingWork(works, tensors) if works else _done(tensors)


class PendingWork(dist.Work):
    """gpucomm Works in flight, as torch's Work.

    ``wait()`` raises their error: a Work made by ``_create_work_from_future`` returns True from
    ``wait()`` even when its Future holds an error (torch 2.13), and a timed-out collective would
    pass for a finished one. ``get_future()`` completes when every Work has (gloo's thread, the
    progress thread, or stream order on a GPU) without anyone waiting: DDP chains its bucket's
    next steps on it, so the all-reduces run while the backward pass goes on.
    """

    def __init__(self, works: Sequence[Work], tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._works = list(works)
        self._tensors = tensors

    def wait(self, timeout: object = None) -> bool:
        timeout = _no_timeout_as_none(timeout)
        for work in self._works:
            work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._works)

    def exception(self) -> BaseException | None:
        return next((work.exception() for work in self._works if work.exception() is not None), None)

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        futures = [work.get_future() for work in self._works]
        combined = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
        tensors, several = self._tensors, len(futures) > 1

        def result(done: torch.futures.Future) -> list[torch.Tensor]:
            values = done.value()  # raises the collective's error
            for inner in values if several else ():
                inner.value()
            return tensors

        return combined.then(result)
