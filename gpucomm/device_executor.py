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

import contextlib
from typing import TYPE_CHECKING

import torch

from gpucomm.channels import launch_channels
from gpucomm.errors import CommMismatchError, CommTimeoutError, GpucommError, UnsupportedError
from gpucomm.program import COPY, MISMATCH, OPERAND_WORDS, RECORD_WORDS, REDUCE, SYNC, WORDS, Program, Slot

if TYPE_CHECKING:
    from gpucomm.engine import Engine

__all__ = ["DeviceExecutor"]

_ALIGN = 16
# SYNC names its peers in an int64 bit mask.
MAX_WORLD = 63
# Fingerprints of programs launched, kept to name the call an error record points at.
_NAMES_KEPT = 1024


class DeviceExecutor:
    """Runs the programs of one engine with its program kernel; see the module docstring."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.kernels = engine.kernels
        self.device = engine.device
        self.channels = engine.channels
        self.channels_by_size = engine.channels_by_size
        ws, flags, me = engine.workspace, engine.flags, engine.rank
        P = engine.world_size
        if P > MAX_WORLD:
            raise UnsupportedError(f"gpucomm: the program kernels serve up to {MAX_WORLD} ranks per node, got {P}; use kernels=torch")
        halves = [ws.data(p, engine.p2p_bytes, 0).addr for p in range(P)]
        flag_areas = [ws.flag(p, 0).addr for p in range(P)]
        self.peers = torch.tensor(halves + flag_areas, dtype=torch.int64).to(self.device)
        self.state_addr = ws.flag(me, flags.state).addr
        self._epoch_flag = ws.flag(me, flags.epoch(0))
        pinned = self.device.type == "cuda"
        self.record = torch.zeros(self.channels * RECORD_WORDS, dtype=torch.int64, pin_memory=pinned)
        self._kinds = self.record.numpy()[::RECORD_WORDS]  # host view: reading it waits for nothing
        self._timeout_ns = int(engine.timeout * 1e9)
        self._names: dict[int, str] = {}

    def epoch(self) -> int:
        """Channel 0's epoch once the launches so far have run (waits for the device)."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return int(self._epoch_flag.view(torch.int64)[0])

    def run(self, program: Program) -> None:
        self.check()
        form = program.cache.get("device")
        if form is None:
            form = program.cache["device"] = self._prepare(program)
        self._names[program.fingerprint] = program.name
        if len(self._names) > _NAMES_KEPT:
            self._names.pop(next(iter(self._names)))
        engine = self.engine
        guard = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with guard:
            self.kernels.run_program(
                form["instructions"], form["operands"], self.peers, self.state_addr, self.record.data_ptr(),
                channels=form["channels"], all_channels=self.channels, rank=engine.rank, world=engine.world_size,
                fingerprint=program.fingerprint, half_bytes=engine.half_bytes, granule=form["granule"], timeout_ns=self._timeout_ns,
                dtype=program.dtype, op=int(program.op or 0), copy_bytes=form["copy_bytes"], aligned=form["aligned"],
            )
        if self.device.type != "cuda":
            self.check()  # the launch has run: its errors are there now

    def check(self) -> None:
        """Raise the error an earlier launch recorded, if any (never waits for the device)."""
        if self._kinds.any():
            raise self._error()

    # -- tables -------------------------------------------------------------------------------
    def _prepare(self, program: Program) -> dict:
        """The tables of a program, on the device, and its launch constants."""
        rows: list[list[int]] = []
        operands: list[list[int]] = []
        largest = 0
        for ins in program.instructions:
            if ins[0] == SYNC:
                rows.append([SYNC, _mask(ins[1]), _mask(ins[2]), 0, 0, 0, 0, 0])
                continue
            named = [ins[3], ins[4]] if ins[0] == COPY else [ins[3], *ins[4]]
            first = len(operands)
            operands += [_operand(r) for r in named]
            divide, divisor = (int(ins[5]), ins[6]) if ins[0] == REDUCE else (0, 1)
            rows.append([ins[0], ins[1], ins[2], len(named) - 1, first, divide, divisor, 0])
            largest = max(largest, ins[1])
        # Channel c owns the in-half positions of granules c, c + C, ...: one contiguous share of
        # the half each where the program uses the workspace; copies outside it (between this
        # rank's own buffers) wrap around the channels. The grid follows the program's size
        # (gpucomm.channels), the same on every rank.
        extent = program.extent or largest
        grid = launch_channels(extent, self.channels) if self.channels_by_size else self.channels
        granule = max(_ALIGN, -(-extent // grid // _ALIGN) * _ALIGN)
        return {
            "channels": grid,
            "instructions": self._upload(rows, WORDS),
            "operands": self._upload(operands, OPERAND_WORDS),
            "granule": granule,
            "copy_bytes": program.copy_bytes(),
            "aligned": program.aligned(),
        }

    def _upload(self, rows: list[list[int]], width: int) -> torch.Tensor:
        table = torch.tensor(rows or [[0] * width], dtype=torch.int64).reshape(-1)
        if self.device.type != "cuda":
            return table
        # From pinned memory without blocking: building a program never waits for the device.
        return table.pin_memory().to(self.device, non_blocking=True)

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
                f"collectives (or sizes, dtypes, ops, roots or algorithms) at the same step"
            )
        missing = sorted({engine.members[p] for r in records for p in _ranks(r[3])})
        return CommTimeoutError(name, epoch, engine.comm_rank, missing, engine.timeout)


def _operand(region: object) -> list[int]:
    if isinstance(region, Slot):
        return [region.peer, region.round, region.offset]
    return [-1, 0, region.addr]  # type: ignore[attr-defined]


def _mask(ranks: list[int]) -> int:
    mask = 0
    for p in ranks:
        mask |= 1 << p
    return mask


def _ranks(mask: int) -> list[int]:
    return [p for p in range(64) if mask >> p & 1]
