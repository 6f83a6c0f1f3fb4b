"""``DeviceExecutor``: runs each program in one launch of the program kernel, the host never waiting.

The kernels (Triton's ``kernels/triton/program.py``, or CUDA C++'s ``kernels/cuda/program.cu``)
run the whole program on the device: the copies, the reductions and every wait, with the epochs
of the channels kept in the workspace (the engine's flag layout). A launch's arguments are only
what a program keeps from one call to the next (its tables, the workspace's addresses, sizes,
the timeout), so the launch of one call can be replayed as it is, by a CUDA graph for instance.

Errors come back as records: a channel whose wait times out, or sees a peer's flag at this epoch
with another call's fingerprint, writes a record into host-visible memory (pinned host memory
on a GPU, plain memory under the interpreter) and poisons the workspace so that every later
launch does nothing. :meth:`DeviceExecutor.check` turns a record into
:class:`CommTimeoutError` or :class:`CommMismatchError` without waiting for the device; it runs
before every launch, after every launch on the CPU (where a launch returns when it has run),
and wherever the communicator looks for errors off the hot path.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from gpucomm.capture import capturing
from gpucomm.errors import CommMismatchError, CommTimeoutError, GpucommError, UnsupportedError
from gpucomm.ops.device_guard import on_device
from gpucomm.ops.instruction_set import (
    CARRIED,
    MISMATCH,
    OPERAND_WORDS,
    RECORD_WORDS,
    REDUCE,
    STORE_ALSO,
    SYNC,
    WORDS,
)
from gpucomm.ops.launch_args import MAX_PROGRAM_WORLD, ProgramArgs
from gpucomm.ops.program import Program, Slot, carried, operands, resolve
from gpucomm.roles import FlagWords, NodeWorkspace
from gpucomm.workspace.channels import granule as granule_of
from gpucomm.workspace.channels import launch_channels
from gpucomm.workspace.graph_buffers import CapturedBuffers
from gpucomm.workspace.stream_order import StreamOrder

__all__ = ["DeviceExecutor", "DeviceEngine", "operand_rows", "instruction_rows", "channel_layout"]

_ALIGN = 16
# Operand tables kept per program, one per set of buffer addresses it ran on (a training loop
# reuses the same buffers; a loop of fresh tensors at new addresses replaces the oldest).
_BINDINGS = 8
# Fingerprints of programs launched, kept to name the call an error record points at.
_NAMES_KEPT = 1024


@runtime_checkable
class DeviceEngine(NodeWorkspace, Protocol):
    """What this executor reads of its engine (:class:`gpucomm.workspace.engine.Engine`): the node's
    workspace, the words of its flag area, its channels, the order of its launches on a GPU and
    the copy of tables to its device."""

    channels: int  # channels of the flag layout: the most a launch runs
    channels_by_size: bool  # a launch's grid follows its program's size (else every channel)

    @property
    def flags(self) -> FlagWords: ...

    @property
    def order(self) -> StreamOrder | None: ...  # None off a GPU

    def upload(self, table: torch.Tensor) -> torch.Tensor: ...  # host memory to the device, never waiting


class DeviceExecutor:
    """Runs the programs of one engine with its program kernel; see the module docstring."""

    def __init__(self, engine: DeviceEngine) -> None:
        self.engine = engine
        self.kernels = engine.kernels
        self.device = engine.device
        self.channels = engine.channels
        self.channels_by_size = engine.channels_by_size
        ws, flags, me = engine.workspace, engine.flags, engine.rank
        P = engine.world_size
        if P > MAX_PROGRAM_WORLD:
            raise UnsupportedError(
                f"gpucomm: the program kernels serve up to {MAX_PROGRAM_WORLD} ranks per node, got {P}; "
                f"use kernels=torch"
            )
        halves = [ws.data(p, engine.p2p_bytes, 0).addr for p in range(P)]
        flag_areas = [ws.flag(p, 0).addr for p in range(P)]
        self.peers = torch.tensor(halves + flag_areas, dtype=torch.int64).to(self.device)
        self.state_addr = ws.flag(me, flags.state).addr
        # The flag's index, not a view of it: a view held here (the engine and its executor refer
        # to each other) would keep the workspace mapped after close until the garbage collector
        # found the pair (tests/reliability/test_failures.py counts the open files of 10 init/close rounds).
        self._epoch_index = flags.epoch(0)
        pinned = self.device.type == "cuda"
        self.record = torch.zeros(self.channels * RECORD_WORDS, dtype=torch.int64, pin_memory=pinned)
        self._kinds = self.record.numpy()[::RECORD_WORDS]  # host view: reading it waits for nothing
        self._no_kinds = bytes(self._kinds.nbytes)
        self._timeout_ns = int(engine.timeout * 1e9)
        self._names: dict[int, str] = {}
        self._on_gpu = self.device.type == "cuda"
        # A launch on a GPU names the caller's current stream: one C call for its handle.
        self._stream = (
            functools.partial(torch._C._cuda_getCurrentRawStream, self.device.index) if self._on_gpu else None
        )
        self.graphs = CapturedBuffers(self, operand_rows)  # captured calls in place on the users' tensors
        self._deferred: list | None = None  # tables to fill after a capture (bind_deferred)

    def epoch(self) -> int:
        """Channel 0's epoch once the launches so far have run (waits for the device)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return int(self.engine.workspace.flag(self.engine.rank, self._epoch_index).view(torch.int64)[0])

    def run(self, program: Program, addrs: tuple[int, ...] = ()) -> None:
        """Launch ``program`` on the call's buffers at ``addrs`` (see :class:`gpucomm.ops.program.Arg`)."""
        self.check()
        if not program.instructions:
            # Nothing to move and no SYNC (an all_to_all's delivery on a rank that sends and
            # receives nothing): a launch would leave the epochs where they are (only SYNCs advance
            # them), so there is none, on this rank alone as on all of them.
            return
        if self._on_gpu and capturing(self.device):
            inplace = self.graphs.launch(program, addrs)  # gpucomm.workspace.graph_buffers
            if inplace is not None:
                with on_device(self.device):
                    inplace["launch"](self._stream())
                return
        form = program.cache.get("device")
        if form is None:
            self._no_upload_in_capture(program)
            form = program.cache["device"] = self._prepare(program)
        bound = form["bound"].get(addrs)
        if bound is None:
            self._no_upload_in_capture(program)
            bound = self._bind(program, form, addrs)
        elif self._on_gpu and capturing(self.device):
            bound["captured"] = True
        if self._on_gpu:
            with on_device(self.device):  # for Triton's own launcher (no gpucomm launcher here)
                bound["launch"](self._stream())
        else:
            bound["launch"]()
            self.check()  # the launch has run: its errors are there now

    def remember(self, fingerprint: int, name: str) -> None:
        """Name the call whose flags carry ``fingerprint``, for the error an error record that
        points at it raises (kernels that share this executor's records: gpucomm.workspace.small)."""
        self._names[fingerprint] = name
        if len(self._names) > _NAMES_KEPT:
            self._names.pop(next(iter(self._names)))

    def _no_upload_in_capture(self, program: Program) -> None:
        """Tables go to the device by a host-to-device copy, which a CUDA graph would replay from
        host memory that is gone by then: a shape is captured only after an eager call made them."""
        if capturing(self.device):
            raise UnsupportedError(
                f"gpucomm.{program.name}: this call shape, on these tensors, has not run outside a CUDA graph on this "
                f"communicator, so its tables are not on the device yet; run the same call once eagerly (a warm-up "
                f"step on the same tensors) before capturing it"
            )

    def check(self) -> None:
        """Raise the error an earlier launch recorded, if any (never waits for the device)."""
        if self._kinds.tobytes() != self._no_kinds:  # two C calls: this runs around every launch
            raise self._error()

    def bind(self, program: Program, addrs: tuple[int, ...]) -> Callable[[], None]:
        """The launch of ``program`` on buffers at ``addrs``: calling it does what :meth:`run`
        does, with the binding looked up once, here. The engine's all_reduce calls it, and
        :mod:`gpucomm.workspace.repeat` keeps it: the first and the repeated call run this launch.

        Binds ``program`` to ``addrs`` where it is not yet, as :meth:`run` does: after raising the
        error an earlier launch recorded, and never inside a CUDA graph capture (UnsupportedError).
        """
        form = program.cache.get("device")
        bound = None if form is None else form["bound"].get(addrs)
        if bound is None:
            self.check()
            self._no_upload_in_capture(program)
            if form is None:
                form = program.cache["device"] = self._prepare(program)
            bound = self._bind(program, form, addrs)
        if self._on_gpu:
            return self._bind_on_caller_stream(program, addrs, bound)
        launch, check = bound["launch"], self.check

        def launch_here(_binding: dict = bound) -> None:  # keeps the binding's tables (see below)
            check()
            launch()
            check()  # the launch has run: its errors are there now

        return launch_here

    def _bind_on_caller_stream(self, program: Program, addrs: tuple[int, ...], bound: dict) -> Callable[[], None]:
        """A blocking call's launch on the caller's current stream, after the communicator's
        launches so far (:mod:`gpucomm.workspace.stream_order`: a C call and a comparison when the stream is
        the last one's). While a CUDA graph captures, the full path's steps: the program and its
        tables marked captured, so that they stay as long as the graph. With another device
        current than this one, :meth:`run` (it makes this one current for the launch)."""
        to_caller, check, run, stream = self.engine.order.to_caller, self.check, self.run, self._stream
        launch = bound["launch"]
        index, current_device = self.device.index, torch._C._cuda_getDevice

        # The launch holds its operand table's address, not the tensor: the closure holds the
        # binding, so that the executor dropping it (more buffers than _BINDINGS) frees nothing
        # this launch reads. Without it the next table may take that memory, and the launch reduce
        # another buffer (seen on an H100).
        def launch_on_caller(_binding: dict = bound) -> None:
            if not to_caller():
                program.captured = True  # as Engine.program marks it in a capture
                run(program, addrs)
            elif current_device() != index:
                run(program, addrs)
            else:
                check()
                launch(stream())

        return launch_on_caller

    # -- tables -------------------------------------------------------------------------------
    def _prepare(self, program: Program) -> dict:
        """A program's instruction table on the device, and its launch constants: what does not
        depend on the call's buffers. Their operand tables are bound per call (:meth:`_bind`)."""
        rows = instruction_rows(program)
        # Channel c owns the in-half positions of granules c, c + C, ... (gpucomm.workspace.channels.granule:
        # 1/P of the extent over the grid, so that a 1/P slice is shared by every channel as much
        # as a whole piece); copies outside the halves (between this rank's own buffers, or in
        # place on a symmetric tensor) wrap around the channels by their position in the
        # instruction. The grid follows the program's size (gpucomm.workspace.channels), the same on every rank.
        self.remember(program.fingerprint, program.name)  # to name the call an error record points at
        grid, granule = channel_layout(program, self.engine.world_size, self.channels, self.channels_by_size)
        return {
            "channels": grid,
            "instructions": self._upload(rows, WORDS),
            "granule": granule,
            "bound": collections.OrderedDict(),
        }

    def _bind(self, program: Program, form: dict, addrs: tuple[int, ...]) -> dict:
        """The operand table of ``program`` on buffers at ``addrs``, kept for the next call on them."""
        engine = self.engine
        table = self._upload(operand_rows(program, addrs), OPERAND_WORDS)
        # Every argument of the launch checked and packed once: a repeated call passes none of its
        # own. On a GPU the result's launch(stream) is one call into the driver (gpucomm.ops.launcher).
        args = ProgramArgs(
            instructions=form["instructions"],
            operands=table,
            peers=self.peers,
            state_addr=self.state_addr,
            record_addr=self.record.data_ptr(),
            channels=form["channels"],
            all_channels=self.channels,
            rank=engine.rank,
            world=engine.world_size,
            fingerprint=program.fingerprint,
            half_bytes=engine.half_bytes,
            granule=form["granule"],
            timeout_ns=self._timeout_ns,
            dtype=program.dtype,
            op=int(program.op or 0),
            copy_bytes=program.copy_bytes(addrs),
            aligned=program.aligned(addrs),
            ident_word=engine.flags.identity,
            identity=program.identity,
        )
        prepared = self.kernels.prepare_program(args)
        launch = prepared.launch if self._on_gpu else prepared
        bound = {"operands": table, "launch": launch, "captured": capturing(self.device)}
        kept = form["bound"]
        kept[addrs] = bound
        if len(kept) > _BINDINGS:
            # The oldest binding no captured graph launches (a graph's tables stay with it).
            stale = next((key for key, b in kept.items() if not b["captured"]), None)
            if stale is not None:
                del kept[stale]
        return bound

    def bind_deferred(self, program: Program, addrs: tuple[int, ...]) -> tuple[dict, list]:
        """Bind ``program`` to ``addrs`` inside a CUDA graph capture: its tables are allocated on the
        device now (the graph's memory pool) and left unwritten, since a host-to-device copy
        would be captured and replay from host memory gone by then. Returns the binding and the
        ``(device table, host table)`` pairs to copy once the capture has ended
        (gpucomm.workspace.graph_buffers); on the CPU the tables are host memory, already written."""
        self._deferred = []
        try:
            form = program.cache["device"] = self._prepare(program)
            bound = self._bind(program, form, addrs)
        finally:
            deferred, self._deferred = self._deferred, None
        return bound, deferred

    def _upload(self, rows: list[list[int]], width: int) -> torch.Tensor:
        table = torch.tensor(rows or [[0] * width], dtype=torch.int64).reshape(-1)
        if self.device.type != "cuda":
            return table
        if self._deferred is not None:  # inside a capture (bind_deferred)
            self._deferred.append((torch.empty_like(table, device=self.device), table))
            return self._deferred[-1][0]
        return self.engine.upload(table)

    # -- errors -------------------------------------------------------------------------------
    def _error(self) -> GpucommError:
        engine = self.engine
        records = [r for r in self.record.view(self.channels, RECORD_WORDS).tolist() if r[0]]
        mismatch = [r for r in records if r[0] == MISMATCH]
        _, epoch, _, culprits, _, fp = (mismatch or records)[0][:6]
        name = self._names.get(fp, "collective")
        if mismatch:
            peer = engine.members[_ranks(culprits)[0]]
            return CommMismatchError(
                f"gpucomm.{name} epoch {epoch}: rank {engine.comm_rank} and rank {peer} called different "
                f"collectives (or sizes, dtypes, ops, roots or algorithms) at the same step",
                op=name,
                epoch=epoch,
                rank=engine.comm_rank,
                peers=[peer],
            )
        missing = sorted({engine.members[p] for r in records for p in _ranks(r[3])})
        return CommTimeoutError(name, epoch, engine.comm_rank, missing, engine.timeout)


def channel_layout(program: Program, world: int, channels: int, by_size: bool = True) -> tuple[int, int]:
    """(grid, granule) of ``program``'s launch among ``world`` ranks, out of ``channels``
    (every one unless ``by_size``): what the kernels split its instructions by, the same on
    every rank (gpucomm.workspace.channels). The performance model and the tests count with it too."""
    largest = max((ins[1] for ins in program.instructions if ins[0] != SYNC), default=0)
    extent = program.extent or largest
    grid = launch_channels(max(extent, program.grid_bytes), channels) if by_size else channels
    # Outside the halves every instruction is its own slice: share each over the grid. A program whose
    # pieces differ (a pipelined two-shot's short first piece) sizes its granules by the shortest.
    return grid, granule_of(program.granule_extent or extent, grid, world if program.extent else 1)


def operand_rows(program: Program, addrs: tuple[int, ...]) -> list[list[int]]:
    """The operand table of ``program`` on the call's buffers at ``addrs``, row by row."""
    rows: list[list[int]] = []
    for ins in program.instructions:
        if ins[0] != SYNC:
            rows += [_operand(r, addrs) for r in operands(ins)]
    return rows


def _operand(operand: object, addrs: tuple[int, ...]) -> list[int]:
    if isinstance(operand, Slot):
        return [operand.peer, operand.round, operand.offset]
    return [-1, 0, resolve(operand, addrs)]  # type: ignore[arg-type]


def instruction_rows(program: Program) -> list[list[int]]:
    """The program kernel's instruction table (WORDS int64 a row, kernels/triton/program.py):
    a SYNC's masks and fence word, a move's size, position, operand count and first operand."""
    if not program.instructions:
        # DeviceExecutor.run launches no such program. A table of none would be uploaded as one
        # zero row (a tensor of no elements cannot be handed to the kernels), which the kernels
        # would run as a move of no bytes whose operands the table does not have.
        raise ValueError(
            f"instruction_rows: expected a program of at least one instruction, got none in {program.name!r}"
        )
    rows: list[list[int]] = []
    first = 0
    for ins in program.instructions:
        if ins[0] == SYNC:
            rows.append([SYNC, _mask(ins[1]), _mask(ins[2]), ins[3], 0, 0, 0, 0])
            continue
        named = len(operands(ins))  # a COPY has 2 (operands refuses any other); a REDUCE k + 1, k + 2 with `also`
        if ins[0] == REDUCE:
            # Word 3: the sources; word 7: STORE_ALSO where the operand after them is a second destination.
            also = STORE_ALSO if len(ins) > 7 else 0
            rows.append([REDUCE, ins[1], ins[2], len(ins[4]), first, int(ins[5]), ins[6], also])
        else:  # word 7: CARRIED where the REDUCE before it runs it inside its loop
            rows.append([ins[0], ins[1], ins[2], named - 1, first, 0, 1, CARRIED if carried(ins) else 0])
        first += named
    return rows


def _mask(ranks: list[int]) -> int:
    mask = 0
    for p in ranks:
        mask |= 1 << p
    return mask


def _ranks(mask: int) -> list[int]:
    return [p for p in range(64) if mask >> p & 1]
