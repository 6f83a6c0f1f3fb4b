"""The host's fast path: a blocking all_reduce seen before is one lookup and one launch.

A training loop reduces the same buffers with the same op call after call. The first call of a
shape goes the whole way (validation, the dtype's wire form, path and algorithm, the program, its
binding to the buffers); if every decision it took depends only on what the lookup key holds (the
tensor's address, element count and dtype, the op, the communicator), :class:`Repeats` keeps the
launch it ended in. The next call with the same key checks the two things the key does not
(the tensor is contiguous and on this path's device) and launches. Entries hold addresses, never
a tensor.

Where the key is not enough, or something must be said or watched per call, the full path
serves: asynchronous calls, staged dtypes (16-bit floats reduced in fp32 elsewhere, other dtypes
as bytes), PREMUL_SUM, gloo, the hierarchical path, the torch kernels on a GPU (they wait on the
host), ``GPUCOMM_BLOCKING_WAIT=1`` on a GPU and ``GPUCOMM_DEBUG=INFO`` (a line per call).

The kept launch is the one the first call ran (:meth:`gpucomm.workspace.engine.Engine.bind_all_reduce`,
bound again here on the same program and buffers): on a GPU it goes on the caller's current
stream, after the communicator's launches so far (:mod:`gpucomm.workspace.stream_order`), and inside
a CUDA graph capture it takes the full path's steps
(:meth:`gpucomm.workspace.device_executor.DeviceExecutor.bind`).

Measured with ``python -m gpucomm._bench.host_time`` (docs/benchmarks.md, "Host time per call").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gpucomm import log
from gpucomm.config import Config
from gpucomm.ops.contract import Kernels
from gpucomm.reduce_op import ReduceOp
from gpucomm.reliability.flight import FlightLog

__all__ = ["Repeats", "Seen", "Repeatable"]

# Kept launches per communicator: a loop's buffers are a few; a caller passing fresh tensors
# each step only refills the table (it is emptied when full, a dict of closures being cheap to
# rebuild and an LRU costing every hit a move).
_KEPT = 64
# Operators whose hash is their meaning (PREMUL_SUM objects are not, and never repeat here).
_KEYED_OPS = (ReduceOp, dist.ReduceOp.RedOpType)

Launch = Callable[[], None]


@runtime_checkable
class Repeatable(Protocol):
    """What :meth:`Repeats.learn` asks of a workspace engine (:class:`gpucomm.workspace.engine.Engine`)."""

    @property
    def stream(self) -> torch.cuda.Stream | None: ...

    @property
    def kernels(self) -> Kernels: ...

    def serves(self, fn: str, tensor: torch.Tensor | None) -> str | None: ...

    def bind_all_reduce(self, tensor: torch.Tensor, op: ReduceOp, algo: str) -> Launch: ...

    def bind_all_reduce_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, algo: str
    ) -> Launch | None: ...


class Seen(NamedTuple):
    """A call seen before: its launch, the device type it ran on, what the flight record keeps
    of it (:meth:`gpucomm.reliability.flight.FlightLog.call`)."""

    launch: Launch
    device_type: str
    flight: tuple[int, int, int, int, int, int]


class Repeats:
    """The launches of blocking all_reduce calls seen before (module docstring)."""

    def __init__(self) -> None:
        self._launches: dict[tuple, Seen] = {}

    def find(self, tensor: torch.Tensor, op: object, output: torch.Tensor | None = None) -> Seen | None:
        """The call seen before on this tensor's buffer with ``op``, or None; with ``output``, the
        out-of-place call (gpucomm.all_reduce_into) into that buffer."""
        if (
            not self._launches
            or op.__class__ not in _KEYED_OPS
            or not isinstance(tensor, torch.Tensor)
            or tensor.layout is not torch.strided
        ):
            return None  # the full path validates whatever is not a plain tensor
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype, op)
        if output is not None:
            if not _pairs(output, tensor):
                return None  # the full path says what is wrong with the pair
            key = (*key, output.data_ptr())
        seen = self._launches.get(key)
        if seen is None or not tensor.is_contiguous() or tensor.device.type != seen.device_type or tensor.is_neg():
            return None  # (a negative view has its tensor's address, and stands for other values)
        return seen

    def learn(
        self,
        engine: Repeatable | None,
        config: Config,
        flight: FlightLog,
        tensor: torch.Tensor,
        op: object,
        rop: ReduceOp,
        fields: dict[str, object],
        output: torch.Tensor | None = None,
    ) -> None:
        """Keep the launch of a blocking all_reduce that just ran, where its key decides it:
        ``engine`` is the communicator's workspace engine for the tensor's device (None: gloo
        serves it), ``config`` its knobs, ``flight`` its flight log; with ``output``, the
        out-of-place call into it, kept only where an out-of-place program served it."""
        if engine is None or op.__class__ not in _KEYED_OPS or log.logger.isEnabledFor(logging.INFO):
            return
        # On a GPU the kept launch goes on the caller's current stream in call order; the torch
        # kernels wait on the host between launches, and GPUCOMM_BLOCKING_WAIT=1 waits for an end
        # event: the full path serves those.
        if engine.stream is not None and (engine.kernels.name == "torch" or config.blocking_wait):
            return
        algo = engine.serves("all_reduce", tensor)
        if algo is None or algo == "hierarchical":
            return
        if output is None:
            launch = engine.bind_all_reduce(tensor, rop, algo)
        else:
            launch = engine.bind_all_reduce_into(output, tensor, rop, algo)
            if launch is None:
                return  # a copy, then the in-place call: the full path serves it
        if len(self._launches) >= _KEPT:
            self._launches.clear()
        call = flight.call("all_reduce", tensor, fields)
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype, op)
        key = key if output is None else (*key, output.data_ptr())
        self._launches[key] = Seen(launch, tensor.device.type, call)

    def clear(self) -> None:
        self._launches.clear()


def _pairs(output: object, tensor: torch.Tensor) -> bool:
    """What the key leaves out of an out-of-place pair, as the full path checks it: a plain
    contiguous tensor of the input's shape, dtype and device, not a negative view."""
    return (
        isinstance(output, torch.Tensor)
        and output.layout is torch.strided
        and output.dtype == tensor.dtype
        and output.shape == tensor.shape
        and output.device == tensor.device
        and output.is_contiguous()
        and not output.is_neg()
    )
