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
        self.source: int | None = None  # the sender's rank, for a completed recv

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
            if self._on_error is None:
                raise
            raise self._on_error(err) from err

