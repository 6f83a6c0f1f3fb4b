"""The node-local flight record: each rank's last calls, in memory the ranks of its node can read.

Every rank of a node keeps a small POSIX shared-memory segment, opened with the communicator as
the shared-memory workspace is (gpucomm.transport.shm), whatever path serves the calls. A waiting
rank reads what its peers are doing without sending anything; :mod:`gpucomm.reliability.story`
turns the records into words.

Layout of one segment (little-endian int64 words, then a string table)::

    header  [magic, pid, strings (count interned), 0]
    ring    RING slots of [entry, seq, collective, dtype, count, op, root, group, call site,
                           entered at, ended at]       (call number ``entry`` in slot entry % RING)
    strings STRINGS entries of STRING_BYTES, NUL-padded UTF-8; id 0 is the empty string

Collective, dtype, op, group and call site are ids into the string table, interned once per
process. Times are ``time.monotonic_ns()`` (one clock for every process of a host). "ended at"
is 0 while the call runs, the time it completed, or minus the time it failed. ``entry`` counts
this rank's calls from 1 (0: never written); a reader copies the segment and orders the slots by
it. A call is one write of its slot and one store of its end time: a reader racing the writer
may see a torn slot once, which a diagnosis can afford and which keeps the hot path unordered.

One record per process and root communicator: subgroups write into their parent's record, with
their own group id, so that a rank of the world group can see that a peer waits in a subgroup.
Ranks are ranks of the node: all ranks on one host (split by ``GPUCOMM_LOCAL_WORLD_SIZE`` where
it pretends smaller nodes); where ranks span hosts, each rank keeps a record of its own and names
its peers by what the store tells (:mod:`gpucomm.reliability.liveness`). The job never dies for
its flight record: where the node's segments cannot be made or opened (a full /dev/shm, ranks
that share a host name but not /dev/shm), every rank of the node agrees to keep a record of its
own in private memory (:attr:`FlightRecord.unshared` says why).

The writer (the slot writes, the clock, the walk up the frames to the caller's file:line) is C,
``kernels/host/flight_record.c`` built by :mod:`gpucomm.toolchain.native`, since the record is
written on every call and in Python it cost a seventh of an 8-byte all_reduce; :class:`PyRecorder`
is its Python twin where it cannot be built. The verdicts the walk needs (is a code object
gpucomm's own, which interned call site is this instruction) are Python's; :class:`FlightLog`
teaches them to the writer once each.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import sys
import time
import types
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from gpucomm.errors import WorkspaceUnavailableError
from gpucomm.toolchain import native
from gpucomm.transport import Workspace, open_workspace
from gpucomm.transport.processes import alive
from gpucomm.transport.workspace import buffer_layout

if TYPE_CHECKING:
    from gpucomm.work import Work

__all__ = ["FlightRecord", "FlightLog", "CallRecord", "RankRecord", "PyRecorder", "recorder"]

MAGIC = 0x6770_6366_6C69_6768  # "gpcfligh"
RING = 64  # calls kept per rank: enough to see a pattern, small enough to copy in a read
STRINGS = 256  # interned strings (call sites, names) per process; later ones show as "?"
STRING_BYTES = 128
_HEADER = struct.Struct("<4q")
_SLOT = struct.Struct("<11q")
_WORD = struct.Struct("<q")
_STRINGS_AT_WORD = 16  # byte offset of the header's string count
_RING_AT = 64
_STRING_TABLE_AT = _RING_AT + RING * _SLOT.size
SEGMENT_BYTES = _STRING_TABLE_AT + STRINGS * STRING_BYTES
_ENDED_AT = 10 * 8  # byte offset of "ended at" in a slot

# Frames in these directories are gpucomm's or torch.distributed's own, not the caller's: the
# gpucomm package (this file is in gpucomm/reliability/) and torch.distributed.
_INTERNAL_DIRS = (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
    os.path.dirname(os.path.abspath(torch.distributed.__file__)) + os.sep,
)


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One call as a rank recorded it."""

    seq: int  # the communicator's call number (equal on every rank of the group)
    name: str  # the collective
    dtype: str
    count: int
    op: str  # "" where the call has none
    root: int  # -1 where the call has none
    group: str  # "world", or "group [ranks]" (global ranks)
    site: str  # the caller's file:line and function
    entered_ns: int
    ended_ns: int  # 0: still in it; > 0: completed then; < 0: failed at -ended_ns

    @property
    def running(self) -> bool:
        return self.ended_ns == 0

    @property
    def completed(self) -> bool:
        return self.ended_ns > 0


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """What one rank's segment said when it was read."""

    rank: int  # global rank
    pid: int
    calls: list[CallRecord]  # oldest first, at most RING

    @property
    def current(self) -> CallRecord | None:
        """The call it is in now, or None."""
        return self.calls[-1] if self.calls and self.calls[-1].running else None

    @property
    def last_completed(self) -> CallRecord | None:
        return next((c for c in reversed(self.calls) if c.completed), None)

    def find(self, group: str, seq: int) -> CallRecord | None:
        """Its call number ``seq`` of ``group``, if still in the ring."""
        return next((c for c in reversed(self.calls) if c.seq == seq and c.group == group), None)

    @property
    def alive(self) -> bool:
        if self.pid <= 0:  # a segment not written yet: no process to ask about
            return False
        return alive(self.pid)


class PyRecorder:
    """The Python twin of ``kernels/host/flight_record.c``'s ``Recorder``: same methods, same bytes.
    For hosts where the C file cannot be built (or ``GPUCOMM_NATIVE=0``).

    Args:
        segment: the rank's own segment, writable.
        ring_at: byte offset of the ring in it.
        slots: slots in the ring, a power of two.
        teacher: ``teacher(frame) -> site``, called where the walk meets a code object or an
            instruction it was not taught; it walks on from ``frame`` and teaches what it finds.
    """

    def __init__(
        self, segment: memoryview, ring_at: int, slots: int, teacher: Callable[[types.FrameType], int]
    ) -> None:
        if slots <= 0 or slots & (slots - 1) or ring_at % 8:
            raise ValueError(
                f"PyRecorder: slots must be a power of two and ring_at a multiple of 8, got {slots} and {ring_at}"
            )
        self._segment = segment
        self._ring_at, self._mask = ring_at, slots - 1
        self._teacher = teacher
        self.entries = 0  # calls entered so far, by every communicator writing here
        # Keyed by id(code), each code object kept alive so that its id is not reused.
        self._codes: dict[int, tuple[types.CodeType, bool]] = {}
        self._sites: dict[tuple[int, int], int] = {}

    def enter(self, seq: int, call: tuple[int, int, int, int, int, int]) -> int:
        """Write the slot of call ``seq``, entered now; its byte offset. ``call``: collective, dtype,
        count, op, root, group; the call site is the first frame outside gpucomm above the caller."""
        if len(call) != 6:
            raise TypeError(f"PyRecorder.enter: call must be (collective, dtype, count, op, root, group), got {call!r}")
        frame = sys._getframe(1)
        site = 0
        while frame is not None:
            known = self._codes.get(id(frame.f_code))
            if known is not None and known[1]:
                frame = frame.f_back
                continue
            site = -1 if known is None else self._sites.get((id(frame.f_code), frame.f_lasti), -1)
            if site < 0:
                site = self._teacher(frame)
            break
        entry = self.entries = self.entries + 1
        at = self._ring_at + (entry & self._mask) * _SLOT.size
        _SLOT.pack_into(self._segment, at, entry, seq, *call, site, time.monotonic_ns(), 0)
        return at

    def end(self, at: int) -> None:
        _WORD.pack_into(self._segment, at + _ENDED_AT, time.monotonic_ns())

    def fail(self, at: int) -> None:
        _WORD.pack_into(self._segment, at + _ENDED_AT, -time.monotonic_ns())

    def teach_code(self, code: types.CodeType, internal: bool) -> None:
        self._codes.setdefault(id(code), (code, internal))

    def teach_site(self, frame: types.FrameType, site: int) -> None:
        self._sites.setdefault((id(frame.f_code), frame.f_lasti), site)

    def close(self) -> None:
        self._codes.clear()
        self._sites.clear()


def _private_workspace() -> Workspace:
    """A one-rank workspace over anonymous memory: the record of a rank whose node could not
    share theirs (no room in /dev/shm, or no /dev/shm in common)."""
    _, size = buffer_layout(SEGMENT_BYTES, 0)
    memory = mmap.mmap(-1, size)
    view = torch.frombuffer(memory, dtype=torch.uint8)

    def release() -> None:
        try:
            memory.close()
        except BufferError:  # a view is still alive: the memory goes with the last one
            pass

    return Workspace("private", 0, 1, torch.device("cpu"), SEGMENT_BYTES, 0, [view.data_ptr()], [view], release)


def recorder(
    segment: memoryview, teacher: Callable[[types.FrameType], int], ring_at: int = _RING_AT, slots: int = RING
) -> object:
    """The writer of ``segment``'s ring: C's ``Recorder`` where it builds, else :class:`PyRecorder`."""
    module = native.load("flight_record")
    if module is None:
        return PyRecorder(segment, ring_at, slots, teacher)
    return module.Recorder(segment, ring_at, slots, teacher)


def teach(writer: object, intern: Callable[[str], int], frame: types.FrameType | None) -> int:
    """The interned call site ``file.py:line in function`` at or above ``frame`` (0: none).

    The site is the first frame outside gpucomm and torch.distributed; ``writer`` is taught each
    verdict on the way, and the site, so that its own walk finds them next time.
    """
    while frame is not None:
        code = frame.f_code
        internal = code.co_filename.startswith(_INTERNAL_DIRS)
        writer.teach_code(code, internal)  # type: ignore[attr-defined]
        if not internal:
            site = intern(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}")
            writer.teach_site(frame, site)  # type: ignore[attr-defined]
            return site
        frame = frame.f_back
    return 0


def _teacher(record: weakref.ref[FlightRecord]) -> Callable[[types.FrameType], int]:
    """The writer's teacher: :meth:`FlightRecord.teach`, through a weak reference (the record
    holds the writer, which holds its teacher)."""

    def teach(frame: types.FrameType) -> int:
        alive = record()
        return 0 if alive is None else alive.teach(frame)

    return teach


class FlightRecord:
    """The segments of one root communicator's node: this rank's to write, its peers' to read.

    Collective: every rank of the root communicator opens it (a shared-memory handshake).
    """

    def __init__(
        self,
        store: torch.distributed.Store,
        prefix: str,
        global_ranks: Sequence[int],
        rank: int,
        local_world_size: int,
        one_host: bool,
        timeout: float,
    ) -> None:
        me = global_ranks[rank]
        if one_host:
            per_node = max(1, local_world_size)
            node = [g for g in global_ranks if g // per_node == me // per_node]
        else:  # ranks on several hosts: which share this one is not known here; keep to ourselves
            node = [me]
        # Why the node's records are not shared (every rank of the node agrees), or "".
        self.unshared = ""
        try:
            self.workspace = open_workspace(
                "shm",
                store=store,
                prefix=f"{prefix}flight/n{node[0]}/",
                rank=node.index(me),
                world_size=len(node),
                data_bytes=SEGMENT_BYTES,
                flag_count=0,
                device=torch.device("cpu"),
                timeout=timeout,
            )
        except WorkspaceUnavailableError as exc:
            self.unshared = str(exc)
            node = [me]
            self.workspace = _private_workspace()
        self.ranks = node  # global ranks on this node, in the order of the segments
        self._mine = memoryview(self.workspace.data(node.index(me)).bytes.numpy())
        self._views = {g: self.workspace.data(i).bytes for i, g in enumerate(node)}
        self._interned: dict[str, int] = {"": 0}
        self.closed = False
        _HEADER.pack_into(self._mine, 0, MAGIC, os.getpid(), 1, 0)
        self.writer = recorder(self._mine, _teacher(weakref.ref(self)))  # writes the ring, for every FlightLog here

    @property
    def entries(self) -> int:
        """Calls entered so far, by every communicator writing here."""
        return self.writer.entries

    def close(self) -> None:
        """Unmap every segment. Idempotent."""
        self.closed = True
        self.writer.close()
        self._mine.release()
        self._views = {}
        self.workspace.close()

    # -- writing ----------------------------------------------------------------------------------
    def intern(self, text: str) -> int:
        """The id of ``text`` in this rank's string table (0 once the table is full)."""
        known = self._interned.get(text)
        if known is not None:
            return known
        ident = len(self._interned)
        if ident >= STRINGS:
            return 0
        raw = text.encode("utf-8", "replace")[: STRING_BYTES - 1]
        at = _STRING_TABLE_AT + ident * STRING_BYTES
        self._mine[at : at + len(raw)] = raw
        _WORD.pack_into(self._mine, _STRINGS_AT_WORD, ident + 1)  # published after its bytes
        self._interned[text] = ident
        return ident

    def teach(self, frame: types.FrameType | None) -> int:
        """The writer's teacher (:func:`teach`)."""
        return teach(self.writer, self.intern, frame)

    def end(self, at: int, ok: bool = True) -> None:
        """Stamp the call at slot offset ``at`` as completed (or failed) now."""
        if ok:
            self.writer.end(at)
        else:
            self.writer.fail(at)

    def slot_of(self, seq: int, group: int) -> int | None:
        """Byte offset of this rank's newest slot of call ``seq`` of group ``group``; None once overwritten."""
        found, newest = None, 0
        for k in range(RING):
            at = _RING_AT + k * _SLOT.size
            entry, slot_seq, *_, slot_group = _SLOT.unpack_from(self._mine, at)[:8]
            if entry > newest and slot_seq == seq and slot_group == group:
                found, newest = at, entry
        return found

    def running(self, at: int) -> bool:
        """Whether the call at slot offset ``at`` has not ended yet."""
        return _WORD.unpack_from(self._mine, at + _ENDED_AT)[0] == 0

    # -- reading ----------------------------------------------------------------------------------
    def has(self, rank: int) -> bool:
        return rank in self._views

    def failed_last(self, rank: int) -> bool:
        """Whether global rank ``rank``'s newest call ended in a failure (False off this node):
        a rank gone after that left because of a failure, and is not the one that caused it."""
        record = self.read(rank)
        return record is not None and bool(record.calls) and record.calls[-1].ended_ns < 0

    def read(self, rank: int) -> RankRecord | None:
        """Global rank ``rank``'s record as it is now, or None if it is not on this node."""
        view = self._views.get(rank)
        if view is None:
            return None
        raw = view.numpy().tobytes()  # one copy: every field below comes from the same moment
        magic, pid, count, _ = _HEADER.unpack_from(raw, 0)
        if magic != MAGIC:
            return RankRecord(rank, 0, [])
        strings = [_string(raw, i) for i in range(min(count, STRINGS))]

        def text(i: int) -> str:
            return strings[i] if 0 <= i < len(strings) else "?"

        slots = sorted(_SLOT.unpack_from(raw, _RING_AT + k * _SLOT.size) for k in range(RING))
        calls = [
            CallRecord(seq, text(name), text(dtype), n, text(op), root, text(group), text(site), entered, ended)
            for entry, seq, name, dtype, n, op, root, group, site, entered, ended in slots
            if entry > 0
        ]
        return RankRecord(rank, pid, calls)


def _string(raw: bytes, ident: int) -> str:
    at = _STRING_TABLE_AT + ident * STRING_BYTES
    return raw[at : at + STRING_BYTES].split(b"\0", 1)[0].decode("utf-8", "replace")


class FlightLog:
    """What one communicator writes into its root's :class:`FlightRecord`: the two hooks of
    ``Router._route`` (:meth:`entered`, :meth:`completed`) and the caller's call site.

    Args:
        record: the root communicator's record.
        group: this communicator's label ("world" for a root over every rank, else its ranks).
    """

    def __init__(self, record: FlightRecord, group: str) -> None:
        self.record = record
        self.group = group
        self._group_id = record.intern(group)
        # The writer's own methods, bound once: the host's fast path calls them directly.
        self.enter = record.writer.enter
        self.completed = record.writer.end
        # (collective, wire dtype, op, user dtype) -> _kind()
        self._kinds: dict[tuple[str, object, object, object], tuple[int, int, int, int, int]] = {}
        # Asynchronous calls not complete when they returned: (slot, entry number, Work).
        self._pending: list[tuple[int, int, Work]] = []

    def entered(self, seq: int, fn: str, tensor: torch.Tensor | None, fields: dict[str, object]) -> int:
        """Record call ``seq`` of ``fn`` entered now; returns its slot for :meth:`completed`.
        Its root is ``fields["root"]`` (a send's or receive's peer is not recorded)."""
        return self.again(seq, self.call(fn, tensor, fields))

    def call(
        self, fn: str, tensor: torch.Tensor | None, fields: dict[str, object]
    ) -> tuple[int, int, int, int, int, int]:
        """What the record keeps of a call, for :meth:`again`: collective, dtype, count, op, root
        and group, as the slot holds them (names interned, the count in the caller's dtype)."""
        dtype = None if tensor is None else tensor.dtype
        key = (fn, dtype, fields.get("op"), fields.get("user_dtype"))
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = self._kind(*key)
        count = 0 if tensor is None else tensor.numel() * kind[3] // kind[4]
        return kind[0], kind[1], count, kind[2], fields.get("root", -1), self._group_id  # type: ignore[return-value]

    def again(self, seq: int, call: tuple[int, int, int, int, int, int]) -> int:
        """Record call ``seq``, described by :meth:`call`, entered now; its slot for :meth:`completed`.

        The writer walks up the frames to the caller's and writes the slot, in C where it builds
        (the cost is measured in docs/reliability.md). The host's fast path calls the writer's
        ``enter`` and ``end`` directly (:attr:`enter`, :attr:`completed`) and sweeps nothing:
        asynchronous calls still pending are stamped by the next call that comes through here.
        """
        if self._pending:
            self._sweep()
        return self.enter(seq, call)

    def completes_with(self, at: int, work: Work) -> None:
        """Stamp the end of the asynchronous call at slot ``at`` that returned ``work``, now or later.

        A host path has run it already, and a GPU call is stamped once queued, as a blocking one is (its
        end event is the watchdog's): both now. A gloo or send/recv call is stamped when a later call of
        this communicator finds it complete (an upper bound of its end).
        """
        if work.side_stream is not None or work.is_completed():
            self.completed(at)
        else:
            self._pending.append((at, self.record.entries, work))

    def _sweep(self) -> None:
        still = []
        for at, entry, work in self._pending:
            if self.record.entries - entry >= RING:
                continue  # its slot holds a later call now
            if work.is_completed():
                self.record.end(at)
            else:
                still.append((at, entry, work))
        self._pending = still

    def failed(self, seq: int) -> None:
        """Stamp call ``seq`` of this communicator as failed now, if its slot still runs it.
        Called where the error is translated: for an asynchronous call, maybe after later calls."""
        at = None if self.record.closed else self.record.slot_of(seq, self._group_id)
        if at is not None and self.record.running(at):
            self.record.end(at, ok=False)

    def _kind(
        self, fn: str, dtype: torch.dtype | None, op: object, user_dtype: object
    ) -> tuple[int, int, int, int, int]:
        """Interned name, dtype and op of a call shape, and the wire and user element sizes."""
        intern = self.record.intern
        wire_size = 1 if dtype is None else dtype.itemsize
        user_size = wire_size
        dtype_name = "" if dtype is None else str(dtype).removeprefix("torch.")
        if isinstance(user_dtype, str):
            user = getattr(torch, user_dtype, None)
            if isinstance(user, torch.dtype):
                user_size, dtype_name = user.itemsize, user_dtype
        return intern(fn), intern(dtype_name), intern("" if op is None else str(op)), wire_size, user_size


def group_label(global_ranks: Sequence[int], root: bool, world_size: int) -> str:
    """How a communicator is named in a record: "world" for a root over ranks 0..n-1."""
    ranks = list(global_ranks)
    if root and ranks == list(range(world_size)):
        return "world"
    return f"group {ranks}"
