"""``StreamOrder``: one communicator's programs run on the device in call order, on any streams.

A blocking call launches on the caller's current stream (as torch's symmetric memory and vLLM's
custom all-reduce do); an asynchronous one on the communicator's own stream, after the caller's.
Epochs, flags and the workspace's halves are reused call after call, so two programs of one
communicator must never run at once: the second could deadlock on flags the first has not
written yet, or overwrite a half the first still reads. Stream order keeps launches on one
stream in order; across streams this class inserts the waits.

The rule. ``last`` is a stream whose tail (what is queued on it now) comes after every launch
of this communicator so far; None before the first. Before a launch on stream S:

- S is ``last``: nothing to do (a loop of blocking calls on one stream pays one C call, the
  current stream's handle, and a comparison);
- otherwise S waits for ``last`` (``S.wait_stream(last)``: an event recorded on ``last`` now, and
  S waiting for it), and S becomes ``last``. S's tail is then after every launch so far, and so
  will the next launch be.

An asynchronous call also makes the engine stream wait for the caller's current stream (its
data comes from there), as before.

Why wait at the switch instead of recording an event after every blocking launch: recording
costs every blocking call an event (a few microseconds of host time on a path of about five);
waiting for the stream's tail at the switch costs nothing until the stream changes. What it
gives up: the event taken at the switch also covers whatever the caller queued on ``last``
after our launch, so the next launch may start later than it needs to (never earlier). Waits
on events recorded before the wait cannot form a cycle, so this delays and never deadlocks.
One caveat: ``last`` is held as a stream object, so a ``torch.cuda.ExternalStream`` whose CUDA
stream the caller destroys after a blocking call on it must not be the stream of that
communicator's last launch (synchronise it and make one more call on another stream first).

CUDA graph capture: while the caller's current stream captures, nothing is waited for and
``last`` stays as it is. A capturing stream may not wait for an event recorded outside its
capture (CUDA refuses it), ``torch.cuda.graph`` synchronises the device before it captures, and
a captured launch runs only when the graph is replayed, ordered by the stream it is replayed on
(as any captured work is). An asynchronous call inside a capture still makes the engine stream
wait for the capturing stream: that is how the engine stream joins the capture.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from gpucomm.capture import capturing_on

__all__ = ["StreamOrder"]


class StreamOrder:
    """The launch order of one communicator's programs on one device (module docstring).

    Args:
        engine: the communicator's own stream (asynchronous calls).
        current: the caller's current stream on the device.
        current_id: its CUDA handle (``Stream.cuda_stream``), cheaper than ``current()``.
        capturing: whether the caller's current stream captures a CUDA graph.
    """

    def __init__(
        self,
        engine: torch.cuda.Stream,
        current: Callable[[], torch.cuda.Stream],
        current_id: Callable[[], int],
        capturing: Callable[[], bool],
    ) -> None:
        self.engine = engine
        self._current = current
        self._current_id = current_id
        self._capturing = capturing
        self.last: torch.cuda.Stream | None = None
        self._last_id: int | None = None

    @classmethod
    def on(cls, device: torch.device, engine: torch.cuda.Stream) -> StreamOrder:
        """The order of launches on CUDA ``device``, whose communicator owns ``engine``."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        return cls(
            engine,
            functools.partial(torch.cuda.current_stream, index),
            functools.partial(torch._C._cuda_getCurrentRawStream, index),  # one C call
            capturing_on(index),  # of this device's current stream, whatever device is current
        )

    def to_caller(self) -> bool:
        """Before a launch on the caller's current stream: make it wait for the launches so far.

        Nothing to wait for where it is ``last``. False, and nothing done, while it captures a CUDA graph.
        """
        if self._capturing():
            return False
        if self._current_id() != self._last_id:
            self._follow(self._current())
        return True

    def to_engine(self) -> None:
        """Before launches on the engine stream: make it wait for the launches so far and the caller's stream.

        In a capture, only for the caller's current stream (that is how the engine stream joins it).
        """
        current = self._current()
        if self._capturing():
            self.engine.wait_stream(current)
            return
        if self._last_id != current.cuda_stream:  # (when it is, the wait below covers it)
            self._follow(self.engine)
        if current.cuda_stream != self.engine.cuda_stream:  # (an upload inside an asynchronous call)
            self.engine.wait_stream(current)
        self.last, self._last_id = self.engine, self.engine.cuda_stream

    def _follow(self, stream: torch.cuda.Stream) -> None:
        """``stream`` waits for ``last``'s tail, and becomes ``last``."""
        if self.last is not None and self._last_id != stream.cuda_stream:
            stream.wait_stream(self.last)
        self.last, self._last_id = stream, stream.cuda_stream
