"""``Work``: the handle ``async_op=True`` returns, as in torch.distributed."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["Work"]


class Work:
    """Completion handle of one collective.

    ``wait()`` blocks until the collective is complete, runs its post-processing step (e.g. the
    rounding of an fp32-accumulated result back into a 16-bit tensor) exactly once, and on a GPU
    orders the current stream after the collective's kernels. Errors of the collective surface
    here, translated by ``on_error``.
    """

    def __init__(
        self,
        pending: Sequence[object] = (),
        finish: Callable[[], None] | None = None,
        event: torch.cuda.Event | None = None,
        on_error: Callable[[RuntimeError], BaseException] | None = None,
    ) -> None:
        self._pending = list(pending)  # torch.distributed Work objects still running
        self._finish = finish
        self._event = event
        self._on_error = on_error
        self._done = False
        self._error: BaseException | None = None
        self.source: int | None = None  # the sender's rank, for a completed recv
        self.outputs: list[torch.Tensor] = []  # the caller's output tensors, for result()

    def is_completed(self) -> bool:
        if not self._done and all(w.is_completed() for w in self._pending):  # type: ignore[attr-defined]
            self._complete()
        return self._done and (self._event is None or self._event.query())

    def is_success(self) -> bool:
        return self.is_completed()

    def wait(self, timeout: object = None) -> bool:
        if not self._done:
            self._complete()
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        return True

    def _complete(self) -> None:
        pending, finish = self._pending, self._finish
        self._pending, self._finish, self._done = [], None, True
        try:
            for work in pending:
                work.wait()  # type: ignore[attr-defined]
            if finish is not None:
                finish()
        except RuntimeError as err:
            self._error = err if self._on_error is None else self._on_error(err)
            if self._error is err:
                raise
            raise self._error from err

    # -- torch.distributed.Work's result API, on today's completion model (complete on wait) --
    def result(self) -> list[torch.Tensor]:
        """The output tensors of the collective, once it is complete (waits for it)."""
        self.wait()
        return list(self.outputs)

    def exception(self) -> BaseException | None:
        """The error the collective ended with, or None (so far, or because it succeeded)."""
        return self._error

    def get_future(self) -> torch.futures.Future:
        """A Future of :meth:`result`, completed when this work is. gpucomm's works complete
        inside ``wait()``, so this waits first; a failure is set on the Future, not raised."""
        future: torch.futures.Future = torch.futures.Future()
        try:
            future.set_result(self.result())
        except RuntimeError as err:
            future.set_exception(err)
        return future

