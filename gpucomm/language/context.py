"""``DeviceContext``: the host side of the device API, one per communicator and device type.

It builds the context table a kernel receives (gpucomm.language.layout lists its words): this
rank, the world size, the timeout, where the error records and the state words are, this rank's
stage, every rank's flag bank and the bases of every symmetric region (the workspace's buffers,
and the symmetric heap once it is open: the heap opens at the first call that needs it, maybe
after the context was made, and :meth:`DeviceContext.add_region` then fills its row in place),
all addressed in this process. After a launch,
:meth:`DeviceContext.check` turns a record into :class:`gpucomm.CommTimeoutError`, the error a
collective raises, naming the ranks that did not arrive.

Failure and recovery. A timed-out wait poisons the device API's own state, never the program
kernel's: the communicator's collectives go on working. The context itself stays failed (its
waits give up at once, :meth:`check` raises again, naming the first failure) until every rank
calls :meth:`recover`, a collective that brings every rank's epochs to one value past every flag
any rank has seen, and clears the poison and the records. The results of the failed launch are
undefined on every rank, including ranks that arrived late and passed their waits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from gpucomm.errors import CommTimeoutError, UnsupportedError
from gpucomm.language import layout
from gpucomm.ops.device_guard import on_device
from gpucomm.roles import NodeWorkspace
from gpucomm.transport.workspace import buffer_layout

__all__ = ["DeviceContext", "DeviceWorkspace", "SymmetricRegion"]

# Distances between two ranks' copies of a region must be whole 16-byte vectors, so that a
# translated pointer keeps the alignment that lets the compiler vectorise (core.translate).
_VECTOR = 16


@runtime_checkable
class DeviceFlags(Protocol):
    """Where the device API's words start in a rank's flag area (:class:`gpucomm.workspace.layout.FlagLayout`)."""

    device_bank: int
    device_state: int


@runtime_checkable
class DeviceWorkspace(NodeWorkspace, Protocol):
    """What a context reads of its engine (:class:`gpucomm.workspace.engine.Engine`): the node's
    workspace, where the device API's flag words and stage lie in it, and the copy of a table
    to the device."""

    stage_half_bytes: int  # bytes of each of the stage's two halves, after the program's halves
    channels: int  # channels of the program kernel's layout: how many programs a launch runs at most

    @property
    def flags(self) -> DeviceFlags: ...

    def upload(self, table: torch.Tensor) -> torch.Tensor: ...

    def on_caller_stream(self) -> None: ...  # order the caller's stream after the communicator's launches


@runtime_checkable
class SymmetricRegion(Protocol):
    """Memory every rank of the node has mapped at the same offsets (the symmetric heap)."""

    @property
    def base_addrs(self) -> Sequence[int]:
        """Each rank's copy, addressed in this process, by rank on the node."""
        ...

    @property
    def nbytes(self) -> int: ...


class _Workspace:
    """The workspace's buffers as a region: every rank's whole buffer (flags and data)."""

    def __init__(self, engine: DeviceWorkspace) -> None:
        ws = engine.workspace
        self.base_addrs = [ws.flags(p, 0, 0).addr for p in range(engine.world_size)]
        self.nbytes = buffer_layout(ws.data_bytes, ws.flag_count)[1]


class DeviceContext:
    """What a kernel written with :mod:`gpucomm.language` needs, and the check after it runs.

    Build it with :meth:`gpucomm.Communicator.device_context`. Pass :attr:`table` as the
    kernel's ``ctx`` argument and ``LANES = 32 * num_warps`` of the launch to the waits.

    Example::

        ctx = comm.device_context()
        my_kernel[(1,)](ctx.table, x, out, x.numel(), LANES=128, num_warps=4)
        ctx.check("my_kernel")  # raises CommTimeoutError if a rank never arrived
    """

    def __init__(
        self,
        engine: DeviceWorkspace,
        agree_max: Callable[[int], int],
        regions: Sequence[SymmetricRegion] = (),
    ) -> None:
        """``agree_max(v)``: the largest ``v`` of every rank (a collective, for :meth:`recover`);
        ``regions``: symmetric memory beside the workspace (the heap; one that opens later
        comes in through :meth:`add_region`)."""
        P, me = engine.world_size, engine.rank
        if P > layout.MAX_WORLD:
            raise UnsupportedError(
                f"gpucomm.device_context: the device API serves up to {layout.MAX_WORLD} ranks per node, got {P}"
            )
        all_regions = [_Workspace(engine), *regions]
        ws, flags = engine.workspace, engine.flags
        self._regions = 0  # rows of the table's region list filled so far
        self.rank = me
        self.world_size = P
        self.comm_rank = engine.comm_rank
        self.members = list(engine.members)
        self.timeout = engine.timeout
        self.device = engine.device
        self.stage_half_bytes = engine.stage_half_bytes
        # Programs gpucomm's own kernels on this context launch at most: the program kernel's
        # (GPUCOMM_CHANNELS, else from the SMs), within the channel slots.
        self.channels = min(engine.channels, layout.CHANNEL_SLOTS)
        self._agree_max = agree_max
        self._on_caller_stream = engine.on_caller_stream
        self._bank = ws.flags(me, flags.device_bank, layout.bank_words(P)).bytes.view(torch.int64)
        self._state = ws.flags(me, flags.device_state, layout.state_words()).bytes.view(torch.int64)
        pinned = engine.device.type == "cuda"
        self.records = torch.zeros(layout.SLOTS * layout.RECORD_WORDS, dtype=torch.int64, pin_memory=pinned)
        self._kinds = self.records.numpy()[:: layout.RECORD_WORDS]  # reading it waits for nothing
        self._no_kinds = bytes(self._kinds.nbytes)
        stage = ws.data(me, engine.p2p_bytes + 2 * engine.half_bytes, 2 * engine.stage_half_bytes)
        self.stage_addr = stage.addr  # this rank's stage, half 0; half 1 follows it
        # Symmetric buffers gpucomm's own kernels keep for this context, by use (heap tensors).
        self.buffers: dict[str, torch.Tensor] = {}
        words = [0] * layout.TABLE_WORDS
        words[layout.RANK], words[layout.WORLD] = me, P
        words[layout.TIMEOUT_NS] = int(engine.timeout * 1e9)
        words[layout.RECORD] = self.records.data_ptr()
        words[layout.STATE] = ws.flag(me, flags.device_state).addr
        words[layout.STAGE], words[layout.STAGE_HALF] = stage.addr, engine.stage_half_bytes
        for p in range(P):
            words[layout.FLAGS + p] = ws.flag(p, flags.device_bank).addr
        for region in all_regions:
            self._region_row(words, region)
        self._host = torch.tensor(words, dtype=torch.int64)
        # The kernel's argument: on the device (copied once), or the host table itself on CPU.
        self.table = self._host if engine.device.type != "cuda" else engine.upload(self._host)

    def _region_row(self, words: list[int] | torch.Tensor, region: SymmetricRegion) -> slice:
        """Write ``region`` into the next free row of the table's region list in ``words``;
        the row's words."""
        i, P, me = self._regions, self.world_size, self.rank
        if i >= layout.REGIONS_MAX:
            raise UnsupportedError(
                f"gpucomm.device_context: {i + 1} symmetric regions, the table holds {layout.REGIONS_MAX}"
            )
        bases = list(region.base_addrs)
        if any((b - bases[me]) % _VECTOR for b in bases):
            raise UnsupportedError(f"gpucomm.device_context: region {i}'s copies are not {_VECTOR}-byte apart: {bases}")
        row = layout.REGIONS + i * layout.REGION_WORDS
        words[row : row + P] = bases if isinstance(words, list) else torch.tensor(bases, dtype=torch.int64)
        words[row + layout.MAX_WORLD] = region.nbytes
        self._regions = i + 1
        return slice(row, row + layout.REGION_WORDS)

    def add_region(self, region: SymmetricRegion) -> None:
        """Add symmetric memory that opened after this context was made (the symmetric heap,
        which opens at the first ``gpucomm.empty``): the table, where kernels already launched
        or captured in a CUDA graph find it, is updated in place. No kernel can have used the
        new row before (it was empty: no pointer lay in it); on a GPU the copy is complete
        before this returns, so every launch after it sees the row."""
        row = self._region_row(self._host, region)
        if self.table is not self._host:  # only the new row: kernels running now read the others
            self.table[row].copy_(self._host[row])
            torch.cuda.current_stream(self.device).synchronize()

    def launch(self, op: str, *launches: Callable[[], None]) -> None:
        """Run ``launches`` (kernels of this context, packed) as one operation named ``op``:
        raise an earlier failure first; on a GPU, order the caller's current stream after the
        communicator's launches so far; on the CPU, check for errors once they have run.

        Example::

            ctx.launch("my_kernel", lambda: my_kernel[(1,)](ctx.table, x, LANES=128, num_warps=4))
        """
        self.check(op)
        self._on_caller_stream()
        with on_device(self.device):  # Triton's JIT launches on the current device: this context's
            for run in launches:
                run()
        if self.device.type != "cuda":
            self.check(op)  # the launches have run: their errors are there now

    def check(self, op: str = "device kernel") -> None:
        """Raise the timeout a kernel of this context recorded, if any, without waiting for the
        device (on a GPU, a launch not finished yet is seen by a later check). ``op`` names the
        kernel in the error. The context stays failed until :meth:`recover`."""
        if self._kinds.tobytes() != self._no_kinds:
            raise self._error(op)

    def _error(self, op: str) -> CommTimeoutError:
        rows = [r for r in self.records.view(layout.SLOTS, layout.RECORD_WORDS).tolist() if r[0]]
        _, awaited, slot, _, seen, _ = rows[0][:6]
        missing = sorted({self.members[p] for r in rows for p in range(64) if r[3] >> p & 1})
        return CommTimeoutError(
            op,
            awaited,
            self.comm_rank,
            missing,
            self.timeout,
            detail=f"a device-API wait on slot {slot} saw {seen}, awaited {awaited}; the device context stays "
            f"failed until every rank calls recover()",
        )

    @property
    def failed(self) -> bool:
        """Whether a wait of this context timed out (until :meth:`recover`)."""
        return self._kinds.tobytes() != self._no_kinds or int(self._state[0]) != 0

    def recover(self) -> int:
        """Make the context usable again after a failure: a collective (every rank calls it, once
        no kernel of the context runs on any rank). Every slot's epoch becomes one value past
        every flag and epoch any rank holds, the poison and the records are cleared. Returns that
        epoch. Flags written before stay below it, so no wait after recovery passes on them."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        local = max(int(self._bank.max()), int(self._state[1:].max()))
        top = self._agree_max(local)
        self._state[1:] = top
        self._state[0] = 0
        self.records.zero_()
        return top
