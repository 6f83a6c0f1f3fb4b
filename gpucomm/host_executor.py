"""``HostExecutor``: runs programs step by step from the host, with the torch reference kernels.

The numerical reference of the program kernels, and the CPU path over shared memory: copies and
reductions are torch ops on views of the workspace, a SYNC is a release store into each peer's
flag and a bounded acquire-poll of this rank's flags. The epoch lives on the host (one channel:
the host is one thread). Waits raise at once, on the rank that waited:
:class:`CommTimeoutError` naming the ranks still missing at the deadline, or
:class:`CommMismatchError` when a peer's flag carries this epoch with another call's fingerprint.
While sends or receives are pending, a wait moves the mailboxes between polls, so that a rank
blocked in a collective still feeds a peer's recv.

Each program is bound once per half parity: its operands resolved to tensor views, so that a
repeated call does no more than the copies, the reductions and the flag traffic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from gpucomm.errors import CommMismatchError, CommTimeoutError
from gpucomm.ops.contract import FLAG_DTYPE, Region
from gpucomm.program import COPY, FP_BITS, REDUCE, Program, Slot
from gpucomm.reduce_op import ReduceOp

if TYPE_CHECKING:
    from gpucomm.engine import Engine

__all__ = ["HostExecutor"]

# While sends or receives are pending, a wait polls in slices this long and moves the mailboxes
# between them.
_PROGRESS_SLICE_S = 0.002

Step = Callable[[], None]


class HostExecutor:
    """Runs the programs of one engine with its (torch) kernels; see the module docstring."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.kernels = engine.kernels
        self.workspace = engine.workspace
        self.rank = engine.rank
        self.world_size = engine.world_size
        self._epoch = 0
        self._program: Program | None = None  # the program being run, for error messages

    def epoch(self) -> int:
        """Syncs done so far (every channel's epoch: the host runs one)."""
        return self._epoch

    def run(self, program: Program) -> None:
        key = ("host", self._epoch % 2)
        steps = program.cache.get(key)
        if steps is None:
            steps = program.cache[key] = self._bind(program, self._epoch % 2)
        self._program = program
        for step in steps:
            step()

    # -- binding ----------------------------------------------------------------------------------
    def _bind(self, program: Program, parity: int) -> list[Step]:
        steps: list[Step] = []
        for ins in program.instructions:
            if ins[0] == COPY:
                dst, src = self._region(ins[3], parity), self._region(ins[4], parity)
                steps.append(lambda dst=dst, src=src: self.kernels.copy(dst, src))
            elif ins[0] == REDUCE:
                out = self._region(ins[3], parity)
                srcs = [self._region(s, parity) for s in ins[4]]
                op = ReduceOp.AVG if ins[5] else program.op
                steps.append(lambda out=out, srcs=srcs, op=op, divisor=ins[6]: self.kernels.reduce(out, srcs, program.dtype, op, divisor))
            else:
                steps.append(self._bind_sync(program, ins[1], ins[2]))
        return steps

    def _region(self, operand: Region | Slot, parity: int) -> Region:
        if isinstance(operand, Region):
            return operand
        engine = self.engine
        offset = engine.p2p_bytes + (parity + operand.round) % 2 * engine.half_bytes + operand.offset
        return self.workspace.data(operand.peer, offset, operand.nbytes)

    def _bind_sync(self, program: Program, signal: Sequence[int], wait: Sequence[int]) -> Step:
        flags = self.engine.flags
        me = self.rank
        at_peers = [self.workspace.flag(p, flags.sync_flag(0, me)) for p in signal]
        mine = [self.workspace.flag(me, flags.sync_flag(0, p)) for p in wait]
        peers = list(wait)

        def sync() -> None:
            self._epoch += 1
            target = self._epoch << FP_BITS
            if at_peers:
                self.kernels.signal(at_peers, target | program.fingerprint)
            if mine:
                self._wait(mine, target, peers)
                self._check_fingerprints(mine, peers, program)

        return sync

    # -- waiting ----------------------------------------------------------------------------------
    def _wait(self, flags: list[Region], target: int, peers: list[int]) -> None:
        """Wait until every flag is >= ``target`` or raise naming the peers still missing."""
        deadline = time.monotonic() + self.engine.timeout
        mail = self.engine.mail
        while True:
            busy = mail.busy()
            until = min(deadline, time.monotonic() + _PROGRESS_SLICE_S) if busy else deadline
            missing = self.kernels.wait(flags, target, until)
            if not missing:
                return
            flags, peers = [flags[i] for i in missing], [peers[i] for i in missing]
            if time.monotonic() >= deadline:
                raise CommTimeoutError(
                    self._program.name, self._epoch, self.engine.comm_rank, [self.engine.members[p] for p in peers], self.engine.timeout
                )
            if busy:
                mail.progress()

    def _check_fingerprints(self, flags: list[Region], peers: list[int], program: Program) -> None:
        if flags[0].device.type == "cpu":
            from gpucomm.ops import host_atomics

            seen = [host_atomics.load_acquire(f.addr) for f in flags]
        else:
            import torch

            seen = torch.stack([f.view(FLAG_DTYPE)[0] for f in flags]).tolist()
        for peer, value in zip(peers, seen):
            if value >> FP_BITS == self._epoch and value & ((1 << FP_BITS) - 1) != program.fingerprint:
                raise CommMismatchError(
                    f"gpucomm.{program.name} epoch {self._epoch}: rank {self.engine.comm_rank} and rank "
                    f"{self.engine.members[peer]} called different collectives (or sizes, dtypes, ops, roots or "
                    f"algorithms) at the same step"
                )
