"""Programs: a collective as a list of instructions, recorded once per call shape and replayed.

The algorithms (:mod:`gpucomm.algorithms`) describe a collective as copies, reductions and
syncs over the symmetric workspace. A :class:`Builder` records those calls into a
:class:`Program`; an executor runs it: the program kernel on a GPU or under the Triton
interpreter (:mod:`gpucomm.workspace.device_executor`), torch ops with host waits for the reference kernels
(:mod:`gpucomm.workspace.host_executor`). A program holds only what stays the same from one call of the
same shape to the next (addresses, sizes, the peers of every sync), never an epoch: which half
of the workspace a round uses, and the epoch every flag carries, come from the epoch at the
start of the run. So the same program runs any number of times, from a CUDA graph too.

Rounds and halves. A *round* is the interval between two syncs; data written in round k lives
in half k % 2 (counted from the epoch the run starts at) and is read in round k + 1, after the
sync that ends round k. ``Builder.write_offset()`` names the half of the current round,
``read_offset()`` that of the last one.

Why every sync is safe to build this way (the engine of earlier versions argued the same for
host-driven steps, and the argument carries over):

- Inside a run, each ``sync(sources, readers)`` waits for the ranks whose data this rank reads
  next and signals the ranks that read its data; the builder adds a carry-over from the
  previous sync (signal last sync's sources: "done reading you"; wait for last sync's readers:
  "done reading me"). So before a rank overwrites a half, every rank that read the old contents
  has said so.
- The first sync of every run is a full barrier, both ways. Data a run writes before its first
  sync goes to the half that the previous run's last round did not read; and a rank passes the
  first sync only once every rank has started this run, that is finished the previous one (runs
  are ordered on a rank: one stream, or one host thread). So a run needs to know nothing about
  the run before it, and any sequence of programs is safe.

Identity. Every rank compares the exact identity of the call at every SYNC, before any result
is written (the first SYNC of a program is a full barrier, and data reaches the caller's
buffers only after it). The flag carries 20 bits of a CRC of the call (``fingerprint``), and
beside each flag the writer stores the call's two identity words (:func:`identity`: the dtype
and count exactly, 47 bits of a hash of the rest), each tagged with its epoch's low 15 bits,
into the reader's identity slot of that epoch's parity (gpucomm.workspace.layout.FlagLayout);
it stores them before its release store of the flag, and the reader loads them after its
acquire load. A reader compares the words whose tag is its epoch's; a word with another tag
was overwritten by the writer's SYNC two epochs on, and is skipped. Why skipping is safe, and
why two slots (by epoch parity) suffice:

- A slot of parity k is written again only at the writer's epoch e + 2. Between its SYNC at e
  and that at e + 2, the writer must pass its wait at e + 1; where that wait includes the
  reader (the builder's carry-over waits for the last sync's readers), the reader has signalled
  e + 1, after its own wait and compare at e: the words of e are still there when it reads.
- Where the writer's wait at e + 1 leaves the reader out, the writer may overwrite the slot
  before a slow reader reads it. Then the reader skips (the tag says e + 2), and nothing is
  lost: every program's first SYNC is a full barrier both ways, so at the first SYNC of each
  call the writer has waited for the reader too, and compared the reader's words of e (which
  the reader, still at e, cannot have overwritten); had they differed, the writer would have
  stopped there with CommMismatchError instead of moving on. The later SYNCs of the call
  carry the same identity as its first.
- One slot would not do: a writer that has passed e may store e + 1's words before the reader
  has read e's (it signals before it waits).

Channels. The program kernel runs a program as several *channels* (one per program of the
launch grid) that never wait for each other: channel c moves only the bytes whose in-half
position lies in the granules it owns (granule g is channel g % grid's, and a granule is 1/P of
the program's extent over the grid: gpucomm.workspace.channels.granule, so every channel shares every
instruction, a 1/P slice as much as a whole piece), and syncs only with channel c of the other
ranks. An instruction's workspace operands therefore share one in-half position (``pos``), so
that the channel that writes a byte of a half is the channel that reads it on every rank. Every launch
runs every channel, so all channels count the same epochs and agree on the half of a round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from gpucomm.ops.call_identity import fingerprint, identity
from gpucomm.ops.contract import Region

# The instruction set, re-exported: the builder's users read the opcodes where they read Program.
from gpucomm.ops.instruction_set import (
    CARRIED,
    COPY,
    FP_BITS,
    MISMATCH,
    OPERAND_WORDS,
    RECORD_WORDS,
    REDUCE,
    SYNC,
    TIMEOUT,
    WORDS,
)
from gpucomm.ops.program_operands import Arg, HalfOffset, Ref, Slot, overlaps, resolve
from gpucomm.reduce_op import ReduceOp

__all__ = [
    "Builder",
    "Program",
    "Slot",
    "Ref",
    "Arg",
    "resolve",
    "overlaps",
    "operands",
    "carried",
    "MAX_CARRIED",
    "HalfOffset",
    "fingerprint",
    "identity",
    "WORDS",
    "OPERAND_WORDS",
    "COPY",
    "REDUCE",
    "SYNC",
    "FP_BITS",
    "RECORD_WORDS",
    "TIMEOUT",
    "MISMATCH",
]

_ALIGN = 16  # bytes of one vector access
# Copies one REDUCE carries: a two-shot's copy-in of every slice but the rank's own is two ranges,
# the slices before it and those after it.
MAX_CARRIED = 2
# The view of a peer's heap region a Builder hands out: programs keep addresses, never views
# (executors make their own from the address: Region.alias).
_NO_VIEW = torch.empty(0, dtype=torch.uint8)


Operand = Region | Slot | Ref | Arg


@dataclass
class Program:
    """A recorded collective (see the module docstring).

    ``instructions`` are tuples ``(COPY, nbytes, pos, dst, src)`` (a COPY is one move), ``(REDUCE,
    nbytes, pos, out, srcs, divide, divisor)`` or, storing into a second destination too
    (``Builder.reduce``'s ``also``), ``(REDUCE, nbytes, pos, out, srcs, divide, divisor, also)``, a
    COPY that the REDUCE before it carries (``Builder.reduce``'s ``carry``: :func:`carried`)
    ``(COPY, nbytes, pos, dst, src, CARRIED)``, and ``(SYNC, signal, wait, fence)`` (lists of local
    ranks). ``syncs`` is their number of SYNCs; ``name``, ``fingerprint`` and ``root`` say which
    call it is. ``dtype`` and ``op`` are those of the REDUCEs (None without any), ``op`` already
    mapped to the fold (AVG sums; each REDUCE says whether it divides). ``extent``: bytes of a half
    the program uses; ``grid_bytes``: more bytes the launch's grid is sized for, where the program
    moves them outside the halves (in place on a symmetric tensor every instruction is a slice of
    it, all of whose channels work on each). Executors cache their own forms of a program in
    ``cache``; ``keep`` holds buffers of the program's own that instructions read. Operands are
    workspace :class:`Slot` s, the call's buffers (:class:`Arg`) and the program's own
    (:class:`Ref`).
    """

    name: str
    fingerprint: int
    root: int | None
    identity: tuple[int, int] = (0, 0)  # the call's identity words (:func:`identity`): < 2**IDENT_BITS
    instructions: list[tuple] = field(default_factory=list)
    syncs: int = 0
    dtype: torch.dtype | None = None
    op: ReduceOp | None = None
    extent: int = 0
    grid_bytes: int = 0  # bytes that size the launch's grid where they exceed ``extent`` (in place: the tensor)
    granule_extent: int = 0  # where not 0, what sizes the granules instead of ``extent`` (its short piece)
    keep: list = field(default_factory=list, repr=False)  # buffers the instructions name, kept alive
    cache: dict = field(default_factory=dict, repr=False)
    captured: bool = False  # a CUDA graph launches it: never evicted (gpucomm.capture)

    def copy_bytes(self, addrs: Sequence[int] = ()) -> int:
        """The widest unit (8, 4, 2, 1) that divides every COPY's size, position and address
        (``addrs``: the call's buffer addresses)."""
        common = 0
        for ins in self.instructions:
            if ins[0] == COPY:
                common |= ins[1] | ins[2]
                for r in operands(ins):
                    common |= r.offset if isinstance(r, Slot) else resolve(r, addrs)
        return next(size for size in (8, 4, 2, 1) if common % size == 0)

    def aligned(self, addrs: Sequence[int] = ()) -> bool:
        """Every address, in-half offset and position is a multiple of 16 bytes."""
        for ins in self.instructions:
            if ins[0] == SYNC:
                continue
            if ins[2] % _ALIGN or any(
                (r.offset if isinstance(r, Slot) else resolve(r, addrs)) % _ALIGN for r in operands(ins)
            ):
                return False
        return True


class Builder:
    """Records the calls of an algorithm into a :class:`Program`.

    The algorithms see the workspace as ``world_size`` local ranks, this one being ``rank``,
    each with two halves of ``half_bytes`` bytes; they call :meth:`copy`, :meth:`reduce` and
    :meth:`sync` in the order every rank runs them.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        half_bytes: int,
        name: str,
        fields: Sequence[object],
        root: int | None = None,
        args: Sequence[Region] = (),
        heap: Sequence[int] | None = None,
    ) -> None:
        self.rank = rank
        self.args = list(args)  # the call's buffers: regions inside them are recorded as Arg
        self.heap = None if heap is None else tuple(heap)  # every local rank's heap base, in this process
        self.world_size = world_size
        self.half_bytes = half_bytes
        self.op_name = name
        self.program = Program(name, fingerprint(name, fields, root), root, identity(name, fields, root))
        self._carry_sources: list[int] = []
        self._carry_readers: list[int] = []

    # -- where data lives -----------------------------------------------------------------------
    def peers(self) -> list[int]:
        """Every local rank, in order."""
        return list(range(self.world_size))

    def spread(self) -> list[int]:
        """Every local rank from this one, ``(rank + i) % P``: a per-peer loop's order. In step i rank
        r reads rank r + i, so every GPU's outbound link serves one reader per step (in rank order all
        would read rank i at once: docs/performance.md). Folds keep :meth:`peers`' rank order."""
        return [(self.rank + i) % self.world_size for i in range(self.world_size)]

    def write_offset(self) -> HalfOffset:
        """The half that data written now goes to (read by its readers after the next sync)."""
        return HalfOffset(self.program.syncs)

    def read_offset(self) -> HalfOffset:
        """The half holding the data written before the last sync, readable now."""
        return HalfOffset(self.program.syncs - 1)

    def slot(self, peer: int, offset: HalfOffset, nbytes: int) -> Slot:
        """``nbytes`` bytes of local rank ``peer``'s half at ``offset``."""
        if not 0 <= peer < self.world_size:
            raise ValueError(f"Builder.slot: peer must be in [0, {self.world_size}), got {peer}")
        if offset.offset < 0 or nbytes < 0 or offset.offset + nbytes > self.half_bytes:
            raise ValueError(
                f"Builder.slot: [{offset.offset}, {offset.offset + nbytes}) is outside a half of "
                f"{self.half_bytes} bytes"
            )
        return Slot(peer, offset.round, offset.offset, nbytes)

    def reserve(self, offset: HalfOffset, nbytes: int) -> None:
        """The round's layout of a half spans ``[offset, offset + nbytes)`` on every rank, whatever
        this rank's own instructions touch of it. The channels split a half by the program's
        extent (gpucomm.workspace.channels.granule), and a byte must belong to the same channel on every
        rank: an algorithm whose ranks use different parts of one layout (scatter's sub-slots,
        all_to_all's uneven pieces) reserves the whole of it on every rank."""
        if offset.offset < 0 or nbytes < 0 or offset.offset + nbytes > self.half_bytes:
            raise ValueError(
                f"Builder.reserve: [{offset.offset}, {offset.offset + nbytes}) is outside a half of "
                f"{self.half_bytes} bytes"
            )
        self.program.extent = max(self.program.extent, offset.offset + nbytes)

    def symmetric(self, peer: int, region: Region) -> Region:
        """Local rank ``peer``'s copy of ``region``, a region of this rank's symmetric heap
        (gpucomm.transport.heap): the same offset in ``peer``'s heap, at its address in this
        process. A program names it as memory of its own (:class:`Ref`): the address stays
        valid as long as the heap, and the heap offset is part of the call's fields."""
        heap = self.heap
        if heap is None or not heap[self.rank] <= region.addr:
            raise ValueError("Builder.symmetric: the region is not in this rank's symmetric heap")
        if not 0 <= peer < self.world_size:
            raise ValueError(f"Builder.symmetric: peer must be in [0, {self.world_size}), got {peer}")
        if peer == self.rank:
            return region
        addr = heap[peer] + region.addr - heap[self.rank]
        return Region(addr, region.nbytes, _NO_VIEW)

    # -- what moves -----------------------------------------------------------------------------
    def copy(self, dst: Operand, src: Operand) -> None:
        """``dst = src``, byte for byte."""
        if dst.nbytes != src.nbytes:
            raise ValueError(
                f"Builder.copy: dst and src must have the same size, got {dst.nbytes} and {src.nbytes} bytes"
            )
        if dst.nbytes:
            self._add((COPY, dst.nbytes, self._position("copy", [dst, src]), dst, src))

    def reduce(
        self,
        out: Operand,
        srcs: Sequence[Operand],
        dtype: torch.dtype,
        op: ReduceOp,
        divisor: int = 1,
        *,
        also: Operand | None = None,
        carry: Sequence[tuple[Operand, Operand]] = (),
    ) -> None:
        """``out = op(srcs[0], srcs[1], ...)`` in the accumulation type, rounded once; AVG
        divides by ``divisor`` (pass AVG only to the last step of a multi-step reduction).

        ``also``: a second destination that gets the same result in the same instruction (a
        two-shot's fold of my slice, into my half for the peers and into my tensor for me: one
        store more, where a copy of it would be a step of its own). It may alias a source at
        the same offset, as ``out`` may: every source of an element is read before it is stored.

        ``carry``: up to MAX_CARRIED copies ``(dst, src)`` the REDUCE carries (a pipelined
        two-shot's next copy-in beside its fold), each recorded as a COPY flagged CARRIED right after
        it, at its own in-half position. The kernels run them inside the fold's loop, their loads in
        flight beside the fold's; any executor may run them alone, in order. Their bytes must be
        disjoint from everything the REDUCE reads or writes (ValueError where a workspace operand
        of theirs overlaps the REDUCE's)."""
        if len(carry) > MAX_CARRIED:
            raise ValueError(f"Builder.reduce: carry takes at most {MAX_CARRIED} copies, got {len(carry)}")
        for dst, src in carry:
            if dst.nbytes != src.nbytes:
                raise ValueError(
                    f"Builder.reduce: a carried copy's dst and src must have one size, got {dst.nbytes} and "
                    f"{src.nbytes} bytes"
                )
        if any(s.nbytes != out.nbytes for s in srcs) or (also is not None and also.nbytes != out.nbytes):
            raise ValueError(f"Builder.reduce: every source and also must have the {out.nbytes} bytes of out")
        fold = ReduceOp.SUM if op is ReduceOp.AVG else op
        program = self.program
        if program.op is None:
            program.dtype, program.op = dtype, fold
        elif (program.dtype, program.op) != (dtype, fold):
            raise ValueError(
                f"Builder.reduce: one program folds one dtype with one op, got {dtype} {fold.name} after "
                f"{program.dtype} {program.op.name}"
            )
        if out.nbytes:
            divides = op is ReduceOp.AVG
            named = [out, *srcs] + ([] if also is None else [also])
            extra = () if also is None else (also,)
            pos = self._position("reduce", named)
            self._add((REDUCE, out.nbytes, pos, out, list(srcs), divides, divisor, *extra))
            for dst, src in carry:
                if dst.nbytes:
                    at = self._position("reduce", [dst, src])
                    if any(isinstance(r, Slot) for r in (dst, src)) and at < pos + out.nbytes and pos < at + dst.nbytes:
                        raise ValueError(
                            f"Builder.reduce: a carried copy at [{at}, {at + dst.nbytes}) overlaps the reduce's "
                            f"[{pos}, {pos + out.nbytes}) in the half"
                        )
                    self._add((COPY, dst.nbytes, at, dst, src, CARRIED))

    def sync(self, sources: Sequence[int] = (), readers: Sequence[int] = (), *, fence: bool = False) -> None:
        """End the round: signal ``readers`` (they read my data of this round) and wait for
        ``sources`` (I read theirs next), plus the carry-over of the last sync; the first sync
        of a program is a full barrier (module docstring).

        ``fence``: the data this sync announces was written by the rank's earlier kernels, not
        by this program (a symmetric tensor read in place): the kernel runs a system-scope fence
        before its release stores, as the signal kernel does (docs/kernel-contract.md)."""
        me = self.rank
        sources = sorted({p for p in sources if p != me})
        readers = sorted({p for p in readers if p != me})
        if self.program.syncs == 0:
            signal_to = wait_for = [p for p in self.peers() if p != me]
        else:
            signal_to = sorted(set(readers) | set(self._carry_sources))
            wait_for = sorted(set(sources) | set(self._carry_readers))
        self._carry_sources, self._carry_readers = sources, readers
        self.program.instructions.append((SYNC, signal_to, wait_for, int(fence)))
        self.program.syncs += 1

    def barrier_all(self, *, fence: bool = False) -> None:
        """A sync with every local rank in both directions (``fence``: as :meth:`sync`'s)."""
        everyone = self.peers()
        self.sync(everyone, everyone, fence=fence)

    def keep(self, tensor: torch.Tensor) -> Region:
        """The region of a buffer the program owns (a table it copies from), kept as long as it."""
        self.program.keep.append(tensor)
        return Region.of(tensor)

    def finish(self) -> Program:
        """The recorded program."""
        return self.program

    # -- helpers --------------------------------------------------------------------------------
    def _add(self, instruction: tuple) -> None:
        program = self.program
        instruction = tuple(self._kept(x) for x in instruction)
        program.instructions.append(instruction)
        if any(isinstance(r, Slot) for r in operands(instruction)):
            program.extent = max(program.extent, instruction[2] + instruction[1])

    def _kept(self, field: object) -> object:
        """What a program keeps of an instruction's field: a region inside one of the call's
        buffers becomes an :class:`Arg` (the first such buffer), any other (a buffer of the
        program's own) a :class:`Ref`."""
        if isinstance(field, list):
            return [self._kept(x) for x in field]
        if not isinstance(field, Region):
            return field
        for index, arg in enumerate(self.args):
            if arg.addr <= field.addr and field.addr + field.nbytes <= arg.addr + arg.nbytes:
                return Arg(index, field.addr - arg.addr, field.nbytes)
        return Ref(field.addr, field.nbytes)  # a buffer the program keeps (Builder.keep)

    def _position(self, fn: str, operands: Sequence[Operand]) -> int:
        """The in-half offset the workspace operands share (0 if there are none)."""
        offsets = {r.offset for r in operands if isinstance(r, Slot)}
        if len(offsets) > 1:
            # Channels split an instruction by in-half position; operands at different positions
            # would be read by a channel other than the one that wrote them.
            raise ValueError(
                f"Builder.{fn}: the workspace operands of one instruction must share their in-half offset, "
                f"got {sorted(offsets)}"
            )
        return offsets.pop() if offsets else 0


def carried(instruction: tuple) -> bool:
    """A COPY that the REDUCE before it carries (``Builder.reduce``'s ``carry``): ``(COPY, nbytes,
    pos, dst, src, CARRIED)``."""
    return instruction[0] == COPY and len(instruction) == 6 and instruction[5] == CARRIED


def operands(instruction: tuple) -> list[Operand]:
    """The operands of an instruction in the order of its operand table: a COPY's dst and src; a
    REDUCE's out, its sources, then its second destination if it has one; none for a SYNC.

    A COPY is one move: ``(COPY, nbytes, pos, dst, src)``, or with CARRIED after them. Any other
    length raises ValueError, so that no executor builds a table with more moves in one COPY than
    the kernels run (they copy operands[first + 1] into operands[first] and nothing else)."""
    if instruction[0] == COPY:
        if len(instruction) != 5 and not carried(instruction):
            raise ValueError(
                "operands: a COPY is (COPY, nbytes, pos, dst, src) or with CARRIED after them: 5 or 6 fields, "
                f"got {len(instruction)}"
            )
        return list(instruction[3:5])
    if instruction[0] == REDUCE:
        return [instruction[3], *instruction[4], *instruction[7:]]
    return []
