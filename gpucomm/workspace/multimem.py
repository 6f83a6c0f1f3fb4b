"""The multimem all_reduce of one engine: NVLink SHARP on a GPU, the multicast view on the CPU.

A symmetric tensor's all_reduce in one launch of ``kernels/triton/multimem.py``: a barrier, a
load-reduce and a store of this rank's 1/P of the tensor at the heap's multicast address, a
barrier. Where it runs:

- on a GPU, when the heap is bound to a multicast object (gpucomm.transport.multicast: every GPU
  of the node reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, and the heap came from the
  driver's virtual-memory API);
- on the CPU under the Triton interpreter, where the multicast view of the shared-memory heap
  stands in for the switch (every rank's copy read in rank order, every copy written).

Elsewhere :attr:`MultimemAllReduce.reason` says in one line why not. Its barriers count calls and
carry no fingerprint: ranks that disagree about the call (one runs multimem, another a program)
end in CommTimeoutError at the deadline, not in CommMismatchError. Which calls take it:
GPUCOMM_ALGO=multimem (a float SUM then leaves the deterministic contract: the switch's fold
order is unknown), or, on a GPU, ``auto`` for the calls whose result does not depend on the
order of the fold (integer SUM, MIN and MAX): docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gpucomm.errors import CommTimeoutError, UnsupportedError
from gpucomm.ops.device_guard import launching_on
from gpucomm.ops.instruction_set import RECORD_WORDS
from gpucomm.reduce_op import ReduceOp
from gpucomm.workspace.channels import MAX_CHANNELS, launch_channels

__all__ = ["MultimemAllReduce", "SIGNAL_PAD_BYTES", "exact_in_any_order"]

# The signal pad at the start of every rank's heap: one int64 word per block (at most
# MAX_CHANNELS blocks), zero at creation and only ever incremented.
SIGNAL_PAD_BYTES = MAX_CHANNELS * 8
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
}


def exact_in_any_order(dtype: torch.dtype, op: ReduceOp) -> bool:
    """Whether every fold order gives the same bits: integer SUM (wrapping), MIN and MAX."""
    return op in (ReduceOp.MIN, ReduceOp.MAX) or (op is ReduceOp.SUM and not dtype.is_floating_point)


class MultimemAllReduce:
    """The multimem path of one engine (module docstring).

    Args:
        heap: the node's symmetric heap (its first SIGNAL_PAD_BYTES are the signal pad).
        mc_base: the heap's multicast address on a GPU, 0 for the CPU's multicast view.
        reason: why the path is unavailable here ("" when it is available).
        channels: blocks a launch runs at most.
        timeout: seconds a barrier waits.
    """

    def __init__(self, heap: object, mc_base: int, reason: str, channels: int, timeout: float) -> None:
        self.heap = heap
        self.mc_base = mc_base
        self.reason = reason
        self.channels = max(1, min(channels, MAX_CHANNELS))
        self._timeout = timeout
        device = heap.device if heap is not None else torch.device("cpu")
        self.state = torch.zeros(1 + MAX_CHANNELS, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        self.record = torch.zeros(MAX_CHANNELS * RECORD_WORDS, dtype=torch.int64, pin_memory=pinned)
        self._kinds = self.record.numpy()[::RECORD_WORDS]

    @property
    def available(self) -> bool:
        return not self.reason

    def unsupported(self, tensor: torch.Tensor, op: ReduceOp) -> str:
        """Why this call cannot take the multimem path ("" if it can)."""
        from gpucomm._kernels.triton.multimem import SWITCH_REDUCES

        if self.reason:
            return self.reason
        name = _DTYPE_NAMES.get(tensor.dtype)
        if name is None or int(op) not in SWITCH_REDUCES[name]:
            return (
                f"the switch does not reduce {tensor.dtype} with {op.name} "
                f"(it reduces float SUM and integer SUM, MIN, MAX)"
            )
        if self.heap is None or not self.heap.contains(tensor):
            return "the tensor is not in the symmetric heap (allocate it with gpucomm.empty)"
        unit = self._unit_bytes(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        if self.heap.offset(tensor) % 16 or nbytes % unit:
            return (
                f"the tensor must start at a 16-byte boundary and span whole {unit}-byte units, "
                f"got offset {self.heap.offset(tensor)} and {nbytes} bytes"
            )
        return ""

    def run(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """All-reduce the symmetric ``tensor`` in place (every rank calls it)."""
        self.bind(tensor, op)()

    def bind(self, tensor: torch.Tensor, op: ReduceOp) -> Callable[[], None]:
        """The launch of :meth:`run` on ``tensor``'s bytes, holding its offset and size, not
        the tensor (for gpucomm.workspace.repeat)."""
        from gpucomm._kernels.triton import multimem

        problem = self.unsupported(tensor, op)
        if problem:
            raise UnsupportedError(f"gpucomm.all_reduce: the multimem path cannot serve this call: {problem}")
        heap = self.heap
        unit = self._unit_bytes(tensor)
        nbytes = tensor.numel() * tensor.element_size()
        units = nbytes // unit
        P, me = heap.world_size, heap.rank
        kernel_args = dict(
            mc_base=self.mc_base,
            peers=heap.bases,
            offset=heap.offset(tensor),
            signal_offset=0,
            state_addr=self.state.data_ptr(),
            record_addr=self.record.data_ptr(),
            rank=me,
            world=P,
            lo=units * me // P,
            hi=units * (me + 1) // P,
            timeout_ns=int(self._timeout * 1e9),
            dtype=_triton_dtype(tensor.dtype),
            op=int(op),
            unit_elems=unit // tensor.element_size(),
            blocks=launch_channels(nbytes, self.channels),  # the same on every rank: the size decides
        )
        on_cpu, check = tensor.device.type == "cpu", self.check
        # Triton's JIT launches on the current device: the heap's, whatever the caller's is.
        launch = launching_on(heap.device, lambda: multimem.launch(**kernel_args))

        def run() -> None:
            check()
            launch()
            if on_cpu:
                check()  # the launch has run: its errors are there now

        return run

    def check(self) -> None:
        """Raise the timeout an earlier launch recorded (never waits for the device)."""
        if self._kinds.any():
            seen = self.record.view(-1, RECORD_WORDS)
            first = next(r for r in seen.tolist() if r[0])
            raise CommTimeoutError(
                "all_reduce",
                first[1],
                self.heap.rank,
                [],
                self._timeout,
                detail=f"multimem barrier: this rank's signal word reached {first[4]}, not every rank arrived",
            )

    @staticmethod
    def _unit_bytes(tensor: torch.Tensor) -> int:
        return 16 if tensor.dtype.is_floating_point else tensor.element_size()


def _triton_dtype(dtype: torch.dtype) -> object:
    import triton.language as tl

    return getattr(tl, _DTYPE_NAMES[dtype])
