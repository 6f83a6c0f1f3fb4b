"""The programs ``python -m gpucomm._bench.breakdown`` times: an all_reduce's program with steps left
out, and the single instructions over a peer's half.

Everything here is a :class:`gpucomm.ops.program.Program` made by the real Builder, run by the
engine's own :class:`gpucomm.workspace.device_executor.DeviceExecutor`:

- :func:`variants`: the all_reduce's real program (the algorithm ``auto`` runs on GPUs, built by
  gpucomm.algorithms.allreduce as the engine builds it) and the same program without its REDUCEs,
  without its COPYs, without its SYNCs, and with nothing to move (the launch alone: one COPY of no
  bytes, since the kernels take no program without instructions). Every
  variant keeps the full program's dtype, op and extent, so that it runs the same compiled kernel
  on the same grid, and has a fingerprint of its own (a peer at another variant is a mismatch, not
  a silent pairing). Only ``full`` computes an all_reduce; without SYNCs a rank reads halves its
  peers may not have written yet.
- :func:`stage`: every rank's data into its half (one COPY and a full-barrier SYNC), so that the
  programs below, which have no SYNC and so leave the epoch where it is, read it from the half
  written before the last sync (round -1) as often as they run.
- :func:`reduce_halves`: one REDUCE of every rank's staged half, in rank order, into a tensor.
- :func:`pull` and :func:`push`: one COPY from a peer's staged half into a tensor, and one from a
  tensor into a peer's half of the current round; :func:`land` reads back what was pushed into
  this rank's half (a SYNC with everyone, then a COPY out), to check a push.
- :func:`fill`: a COPY into this rank's half of the current round (poison before a checked push).
"""

from __future__ import annotations

import dataclasses

import torch

from gpucomm.algorithms import allreduce
from gpucomm.ops.contract import Region
from gpucomm.ops.program import COPY, REDUCE, SYNC, Builder, Program, fingerprint, identity, operands
from gpucomm.reduce_op import ReduceOp

from . import programs

__all__ = [
    "VARIANTS",
    "LEFT_OUT",
    "all_reduce_program",
    "leave_out",
    "moves",
    "variants",
    "stage",
    "reduce_halves",
    "pull",
    "push",
    "land",
    "fill",
]

# Each variant and the opcodes it leaves out of the full program.
LEFT_OUT: dict[str, frozenset[int]] = {
    "full": frozenset(),
    "no_reduce": frozenset({REDUCE}),
    "no_copy": frozenset({COPY}),
    "no_sync": frozenset({SYNC}),
    "empty": frozenset({COPY, REDUCE, SYNC}),
}
VARIANTS = tuple(LEFT_OUT)


def _builder(engine: object, name: str, fields: tuple, tensors: list[torch.Tensor]) -> Builder:
    """A Builder for ``engine``'s ranks and halves, with ``tensors`` as the call's buffers."""
    args = [Region.of(t) for t in tensors]
    return Builder(engine.rank, engine.world_size, engine.half_bytes, name, fields, args=args)


def all_reduce_program(engine: object, tensor: torch.Tensor) -> tuple[str, Program]:
    """The algorithm and program of an in-place SUM all_reduce of ``tensor`` on ``engine``, as the
    engine builds it for the algorithm ``auto`` runs on GPUs (bench/programs.py's ``pick``; the
    small path, ``oneshot_small``, runs one-shot's steps in a kernel of its own: its program is
    one-shot's)."""
    nbytes = tensor.numel() * tensor.element_size()
    algo = programs.pick("all_reduce", nbytes, engine.world_size)
    algo = "oneshot" if algo == "oneshot_small" else algo
    fields = (tensor.dtype, tensor.numel(), ReduceOp.SUM.name, algo)
    b = _builder(engine, "all_reduce", fields, [tensor])
    allreduce.run(algo, b, tensor, ReduceOp.SUM)
    return algo, b.finish()


def leave_out(program: Program, opcodes: frozenset[int], variant: str) -> Program:
    """``program`` without its instructions of ``opcodes``, named ``variant`` in its fingerprint.

    dtype, op, extent and granules stay the full program's: the same kernel on the same grid.
    A COPY that a REDUCE carries goes with the COPYs (it is one)."""
    for opcode in opcodes:
        if opcode not in (COPY, REDUCE, SYNC):
            raise ValueError(f"leave_out: expected opcodes among COPY, REDUCE, SYNC, got {opcode}")
    kept = [ins for ins in program.instructions if ins[0] not in opcodes]
    if not any(ins[0] != SYNC for ins in kept):
        kept.insert(0, _nothing(program))
    fields = (program.fingerprint, *program.identity, "breakdown", variant)
    name = f"{program.name}[{variant}]"
    return dataclasses.replace(
        program,
        name=name,
        fingerprint=fingerprint(name, fields, program.root),
        identity=identity(name, fields, program.root),
        instructions=kept,
        syncs=sum(1 for ins in kept if ins[0] == SYNC),
        cache={},
        captured=False,
    )


def _nothing(program: Program) -> tuple:
    """A COPY of no bytes between the first two operands of ``program``'s first move: an instruction
    that moves nothing, with operands the kernels can resolve. A program needs one: the executor
    refuses a program without instructions (device_executor.instruction_rows), whose table would be
    one zero row with operands past the end of its operand table (the Triton interpreter crashed so)."""
    first = next((ins for ins in program.instructions if ins[0] != SYNC), None)
    if first is None:
        raise ValueError(f"leave_out: {program.name} has no COPY or REDUCE whose operands a no-op could take")
    dst, src = operands(first)[:2]
    return (COPY, 0, first[2], dst, src)


def moves(program: Program) -> list[int]:
    """The opcodes of ``program``'s instructions that do something: its SYNCs, and its COPYs and
    REDUCEs of one byte or more."""
    return [ins[0] for ins in program.instructions if ins[0] == SYNC or ins[1] > 0]


def variants(program: Program) -> dict[str, Program]:
    """Every variant of :data:`VARIANTS`, ``full`` being ``program`` itself."""
    return {v: program if v == "full" else leave_out(program, LEFT_OUT[v], v) for v in VARIANTS}


def stage(engine: object, data: torch.Tensor) -> Program:
    """``data`` into this rank's half, then a SYNC with everyone: afterwards the half written
    before the last sync (round -1 of the next program) holds every rank's data."""
    nbytes = data.numel() * data.element_size()
    b = _builder(engine, "breakdown_stage", (nbytes,), [data])
    b.copy(b.slot(b.rank, b.write_offset(), nbytes), Region.of(data))
    b.sync()  # a program's first sync is a full barrier
    return b.finish()


def reduce_halves(engine: object, out: torch.Tensor) -> Program:
    """One REDUCE (SUM) of every rank's staged half, in rank order, into ``out``; no SYNC."""
    nbytes = out.numel() * out.element_size()
    b = _builder(engine, "breakdown_reduce", (out.dtype, nbytes), [out])
    staged = b.read_offset()  # round -1: the half of the stage program's COPY
    slots = [b.slot(p, staged, nbytes) for p in b.peers()]
    b.reduce(Region.of(out), slots, out.dtype, ReduceOp.SUM)
    return b.finish()


def pull(engine: object, out: torch.Tensor, peer: int) -> Program:
    """One COPY of ``peer``'s staged half into ``out``; no SYNC."""
    nbytes = out.numel() * out.element_size()
    b = _builder(engine, "breakdown_pull", (nbytes,), [out])
    b.copy(Region.of(out), b.slot(peer, b.read_offset(), nbytes))
    return b.finish()


def push(engine: object, src: torch.Tensor, peer: int) -> Program:
    """One COPY of ``src`` into ``peer``'s half of the current round (not the staged one); no SYNC."""
    nbytes = src.numel() * src.element_size()
    b = _builder(engine, "breakdown_push", (nbytes,), [src])
    b.copy(b.slot(peer, b.write_offset(), nbytes), Region.of(src))
    return b.finish()


def fill(engine: object, src: torch.Tensor) -> Program:
    """One COPY of ``src`` into this rank's half of the current round (where pushes land); no SYNC."""
    nbytes = src.numel() * src.element_size()
    b = _builder(engine, "breakdown_fill", (nbytes,), [src])
    b.copy(b.slot(b.rank, b.write_offset(), nbytes), Region.of(src))
    return b.finish()


def land(engine: object, out: torch.Tensor) -> Program:
    """A SYNC with everyone (every push made before it has landed), then this rank's half of the
    round the pushes went to into ``out``."""
    nbytes = out.numel() * out.element_size()
    b = _builder(engine, "breakdown_land", (nbytes,), [out])
    b.sync()
    b.copy(Region.of(out), b.slot(b.rank, b.read_offset(), nbytes))
    return b.finish()
