"""The workspace path: gpucomm's own kernels over the symmetric workspace.

The engine owns what one communicator needs on this path (the workspace, the kernels, the epoch
counter) and the two synchronisation primitives every algorithm is built from:

- ``sync(peers)``: signal my arrival at the next epoch to ``peers``, wait for theirs;
- ``stage(round)``: which half of the data area a round writes (double buffering, below).

Flags. Rank r's flag area holds one int64 per peer p (``flags[p]``), written only by p. A
flag value packs the epoch and the call's fingerprint: ``epoch << FP_BITS | fingerprint``.
Waiting for ``flag >= epoch << FP_BITS`` is the epoch test (flags are monotonic: nothing is
ever reset); a peer whose flag carries *this* epoch must carry my fingerprint too, else the
ranks called different collectives (or sizes, dtypes, ops, roots) and every rank raises
:class:`CommMismatchError`. A peer already past this epoch had checked my fingerprint itself.

Double buffering. The data area is split into two halves; round t writes half t % 2. A round
starts with the writer's own data and a barrier with every rank that reads it, so before round t
overwrites half t % 2, every reader has passed round t - 1's barrier, i.e. finished round t - 2.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpucomm.algorithms import allreduce, select
from gpucomm.errors import CommMismatchError, CommTimeoutError, UnsupportedError
from gpucomm.ops.contract import Region
from gpucomm.ops.registry import get_kernels
from gpucomm.reduce_op import ReduceOp
from gpucomm.transport import open_workspace
from gpucomm.work import Work

if TYPE_CHECKING:
    from gpucomm.communicator import Communicator

__all__ = ["Engine", "FP_BITS"]

FP_BITS = 20  # low bits of a flag: the call's fingerprint; the rest: the epoch (2^43 steps)
_ALIGN = 256  # every staged piece starts 256-byte aligned: full 16-byte vectors for the kernels


class Engine:
    """The workspace path of one communicator."""

    def __init__(self, comm: Communicator, transport: str, device: torch.device) -> None:
        self.rank = comm.rank
        self.world_size = comm.world_size
        self.timeout = comm.timeout
        self.knob_algo = comm.config.algo
        self.transport = transport
        self.device = device
        self.kernels = get_kernels(comm.config.kernels, device)
        self.workspace = open_workspace(
            transport,
            store=comm.store,
            prefix=comm.prefix + "ws/",
            rank=comm.rank,
            world_size=comm.world_size,
            data_bytes=comm.config.workspace_bytes,
            flag_count=comm.world_size,
            device=device,
            timeout=comm.timeout,
        )
        self.half_bytes = (self.workspace.data_bytes // 2) // _ALIGN * _ALIGN
        self.epoch = 0
        self.round = 0
        self.op_name = ""  # the collective being served, for error messages

    @classmethod
    def create(cls, comm: Communicator) -> Engine | None:
        """The engine the knobs ask for, or None where the fallback serves everything."""
        transport = comm.config.transport
        if transport == "auto":
            if comm.device is None:
                return None
            transport = "cuda_ipc"
        device = torch.device("cpu") if transport == "shm" else comm.device
        if device is None:
            raise UnsupportedError(f"gpucomm: GPUCOMM_TRANSPORT={transport} needs a CUDA device, and this host has none")
        return cls(comm, transport, device)

    def close(self) -> None:
        self.workspace.close()

    # -- planning -----------------------------------------------------------------------------
    def serves(self, fn: str, tensor: torch.Tensor | None) -> str | None:
        """The algorithm this path runs ``fn`` with, or None if the fallback must serve it."""
        if tensor is not None and tensor.device.type != self.device.type:
            return None
        nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        return select.choose(fn, nbytes, self.world_size, self.knob_algo)

    def describe(self, algo: str) -> dict[str, object]:
        return {"algo": algo, "transport": self.transport, "kernels": self.kernels.name}

    # -- primitives the algorithms use --------------------------------------------------------
    def begin(self, op_name: str, fingerprint_fields: Sequence[object]) -> None:
        """Start one collective: name it for errors and derive its fingerprint."""
        self.op_name = op_name
        text = "|".join(str(f) for f in (op_name, *fingerprint_fields))
        self.fingerprint = zlib.crc32(text.encode()) & ((1 << FP_BITS) - 1)

    def sync(self, peers: Sequence[int]) -> int:
        """Signal the next epoch to ``peers`` and wait for theirs; returns the epoch."""
        self.epoch += 1
        value = self.epoch << FP_BITS | self.fingerprint
        ws, me = self.workspace, self.rank
        self.kernels.signal([ws.flag(p, me) for p in peers], value)
        deadline = time.monotonic() + self.timeout
        mine = [ws.flag(me, p) for p in peers]
        missing = self.kernels.wait(mine, self.epoch << FP_BITS, deadline)
        if missing:
            raise CommTimeoutError(self.op_name, self.epoch, me, [peers[i] for i in missing], self.timeout)
        self._check_fingerprints(peers, mine)
        return self.epoch

    def _check_fingerprints(self, peers: Sequence[int], flags: Sequence[Region]) -> None:
        seen = torch.stack([f.view(torch.int64)[0] for f in flags]).tolist() if flags else []
        for peer, value in zip(peers, seen):
            if value >> FP_BITS == self.epoch and value & ((1 << FP_BITS) - 1) != self.fingerprint:
                raise CommMismatchError(
                    f"gpucomm.{self.op_name} epoch {self.epoch}: rank {self.rank} and rank {peer} called "
                    f"different collectives (or sizes, dtypes, ops or roots) at the same step"
                )

    def stage(self) -> int:
        """Byte offset of the data half the next round writes."""
        offset = (self.round % 2) * self.half_bytes
        self.round += 1
        return offset

    def pieces(self, numel: int, itemsize: int) -> list[tuple[int, int]]:
        """(first element, count) of each slot-sized piece of a ``numel``-element tensor."""
        per_piece = max(1, self.half_bytes // itemsize)
        return [(start, min(per_piece, numel - start)) for start in range(0, numel, per_piece)] or [(0, 0)]

    def slot(self, peer: int, offset: int, nbytes: int) -> Region:
        return self.workspace.data(peer, offset, nbytes)

    def peers(self) -> list[int]:
        return list(range(self.world_size))

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, algo: str) -> Work:
        self.begin("all_reduce", (tensor.dtype, tensor.numel(), op.name))
        allreduce.run(algo, self, tensor, op)
        return self.completed()

    def barrier(self, *, algo: str) -> Work:
        self.begin("barrier", ())
        self.sync(self.peers())
        return self.completed()

    def completed(self) -> Work:
        """The Work of a collective whose kernels were all issued on the current stream."""
        if self.device.type != "cuda":
            return Work()
        event = torch.cuda.Event()
        event.record()
        return Work(event=event)
