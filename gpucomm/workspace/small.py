"""The small-message all_reduce of one engine: the one-shot with its addresses in its parameters.

``GPUCOMM_ALGO=oneshot_small``, and ``auto`` where it picks one-shot for an all_reduce of up to 64 KiB
on CUDA tensors (:mod:`gpucomm.algorithms.select`), run one launch of ``kernels/triton/small.py`` or
``kernels/cuda/small.cu`` (the engine's kernels) instead of the program kernel's one-shot. The
work is the same (copy into this rank's half, one SYNC, every rank folds every half in rank
order), on the same halves, flags, epochs, error records and poison as the device executor's
programs, so the bits are the one-shot's and launches of either kind follow one another on one
workspace. What differs is where the kernel finds its addresses: every rank's half and flag
area, the tensor, its size and the call's fingerprint are kernel parameters, packed once per
(tensor address, size, dtype, op) and the same for every call of that shape, so a repeated call
is one ``cuLaunchKernel`` and a CUDA graph replays it as it is. The one global load a peer
address depends on is the channel's epoch (tests/ops/test_small_ptx.py counts it in the PTX).

Errors are the device executor's: a timeout or another call's fingerprint at this epoch writes
the channel's record and poisons the workspace, and :meth:`DeviceExecutor.check` raises
:class:`CommTimeoutError` or :class:`CommMismatchError` off the hot path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from gpucomm.capture import capturing
from gpucomm.errors import UnsupportedError
from gpucomm.ops.contract import SUPPORTED_DTYPES
from gpucomm.ops.launch_args import MAX_SMALL_WORLD, SMALL_OPS, SmallArgs
from gpucomm.ops.program import fingerprint, identity
from gpucomm.reduce_op import ReduceOp
from gpucomm.roles import FlagWords, NodeWorkspace
from gpucomm.workspace.channels import launch_channels
from gpucomm.workspace.stream_order import StreamOrder

__all__ = ["SmallAllReduce", "SmallEngine", "MAX_WORLD", "ALGO"]

# The algorithm's name (GPUCOMM_ALGO, the call's fingerprint, the log).
ALGO = "oneshot_small"
# Ranks served: the kernels take one parameter per rank's half and per rank's flag area.
MAX_WORLD = MAX_SMALL_WORLD
_ALIGN = 16
# Launches kept, one per (address, elements, dtype, op): a loop's buffers are a few; fresh
# tensors at new addresses refill the table (emptied when full, as gpucomm.workspace.repeat's).
_KEPT = 64


@runtime_checkable
class SmallEngine(NodeWorkspace, Protocol):
    """What this path reads of its engine (:class:`gpucomm.workspace.engine.Engine`): the node's workspace,
    its kernels and executor (whose state words and error records the kernels share), its channels
    and the order of its launches on a GPU."""

    channels: int  # channels of the flag layout: the most a launch runs
    channels_by_size: bool  # a launch's grid follows its size (else every channel)
    executor: object  # gpucomm.workspace.device_executor.DeviceExecutor where the kernels are Triton's or CUDA C++'s
    caller: str | None  # the caller's dtype, where the call's wire form has another (Engine.calling)
    flags: FlagWords  # where the identity slots start

    @property
    def order(self) -> StreamOrder | None: ...  # None off a GPU


class SmallAllReduce:
    """The small-message all_reduce of ``engine`` (module docstring)."""

    def __init__(self, engine: SmallEngine) -> None:
        self.engine = engine
        ws, P = engine.workspace, engine.world_size
        self.reason = ""
        if engine.kernels.name not in ("triton", "cuda"):
            self.reason = (
                f"it runs gpucomm's Triton or CUDA C++ kernels, and this engine runs kernels={engine.kernels.name}"
            )
        elif P > MAX_WORLD:
            self.reason = f"its kernels take up to {MAX_WORLD} ranks' addresses as parameters, and this node has {P}"
        # Every rank's half 0 and flag area, addressed in this process (the executor's peer table).
        self.stages = [ws.data(p, engine.p2p_bytes, 0).addr for p in range(P)]
        self.flags = [ws.flag(p, 0).addr for p in range(P)]
        if not self.reason and (any(a % _ALIGN for a in self.stages) or engine.half_bytes % _ALIGN):
            self.reason = (
                f"the workspace's halves are not {_ALIGN}-byte aligned ({self.stages}, {engine.half_bytes} bytes)"
            )
        self._launches: dict[tuple, Callable[[], None]] = {}

    def unsupported(self, tensor: torch.Tensor) -> str:
        """Why this path cannot serve an all_reduce of ``tensor`` ("" if it can)."""
        if self.reason:
            return self.reason
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.engine.half_bytes:
            return f"{nbytes} bytes do not fit one half of the workspace ({self.engine.half_bytes} bytes)"
        if tensor.dtype not in SUPPORTED_DTYPES:
            return f"its kernels reduce {[str(d) for d in SUPPORTED_DTYPES]}, not {tensor.dtype}"
        return ""

    def run(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """All-reduce ``tensor`` in place on the current stream (every rank calls it)."""
        self.bind(tensor, op)()

    def bind(self, tensor: torch.Tensor, op: ReduceOp) -> Callable[[], None]:
        """The launch of :meth:`run` on ``tensor``'s buffer (its address and size, not the tensor),
        its checks around it: packed on first use, then kept. On a GPU it first orders the
        caller's current stream after this communicator's launches so far, as the full path does
        (the launch :mod:`gpucomm.workspace.repeat` keeps)."""
        caller = self.engine.caller  # the caller's dtype where the wire's differs (Engine.calling)
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype, op, caller)
        launch = self._launches.get(key)
        if launch is None:
            problem = self.unsupported(tensor)
            if problem:
                raise UnsupportedError(f"gpucomm.all_reduce: GPUCOMM_ALGO={ALGO} cannot serve this call: {problem}")
            if op not in SMALL_OPS:
                raise UnsupportedError(
                    f"gpucomm.all_reduce: GPUCOMM_ALGO={ALGO} folds {[o.name for o in SMALL_OPS]}, not {op.name}"
                )
            if capturing(self.engine.device):
                # Packing compiles the kernel and loads its module: no part of a graph, and a
                # load mid-capture is what the program path refuses too (DeviceExecutor).
                raise UnsupportedError(
                    f"gpucomm.all_reduce: this call shape ({tensor.numel()} x {tensor.dtype}, {op.name}), on this "
                    f"tensor, has not run outside a CUDA graph on this communicator, so its kernel is not compiled "
                    f"and loaded yet; run the same call once eagerly (a warm-up step on the same tensor) before "
                    f"capturing it"
                )
            launch = self._prepare(tensor, op, caller)
            if len(self._launches) >= _KEPT:
                self._launches.clear()
            self._launches[key] = launch
        return launch

    def _prepare(self, tensor: torch.Tensor, op: ReduceOp, caller: str | None) -> Callable[[], None]:
        engine, executor = self.engine, self.engine.executor
        n = tensor.numel()
        to_caller = None if engine.order is None else engine.order.to_caller
        if n == 0:  # every rank passes the same count: none of them syncs
            return (lambda: None) if to_caller is None else (lambda: to_caller() and None)
        # The call's fingerprint as a program of this shape has it, so that a rank running another
        # collective (or the program kernel's one-shot) at this epoch ends in CommMismatchError.
        name, fields = "all_reduce", (tensor.dtype, n, op.name, ALGO)
        if caller is not None:  # as Engine.program adds it
            fields = (*fields, "caller", caller)
        fp = fingerprint(name, fields, None)
        executor.remember(fp, name)
        nbytes = n * tensor.element_size()
        # The grid follows the size as the program kernel's does (gpucomm.workspace.channels): the same on
        # every rank.
        channels = launch_channels(nbytes, engine.channels) if engine.channels_by_size else engine.channels
        args = SmallArgs(
            x=tensor.data_ptr(),
            n=n,
            stages=tuple(self.stages),
            flags=tuple(self.flags),
            half_bytes=engine.half_bytes,
            state_addr=executor.state_addr,
            record_addr=executor.record.data_ptr(),
            rank=engine.rank,
            fingerprint=fp,
            timeout_ns=int(engine.timeout * 1e9),
            channels=channels,
            all_channels=engine.channels,
            divisor=engine.world_size,
            dtype=tensor.dtype,
            op=op,
            ident_word=engine.flags.identity,
            identity=identity(name, fields, None),
        )
        prepared = engine.kernels.prepare_small(args)
        check = executor.check
        if engine.device.type != "cuda":

            def run_here() -> None:
                check()
                prepared()
                check()  # the launch has run: its errors are there now

            return run_here
        device, stream = engine.device, torch._C._cuda_getCurrentRawStream
        launch, index = prepared.launch, engine.device.index

        def run_on_current_stream() -> None:
            to_caller()
            check()
            with torch.cuda.device(device):
                launch(stream(index))

        return run_on_current_stream
