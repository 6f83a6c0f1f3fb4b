"""The node-local flight record: each rank's last calls, in memory the ranks of its node can read.

Every rank of a node keeps a small POSIX shared-memory segment, opened with the communicator
like the shared-memory workspace (gpucomm.transport.shm: names published through the store
under the communicator's prefix, checked by the peers, unlinked once every peer has mapped
them), whatever path serves the calls. A waiting rank reads what its peers are doing without
sending anything; :mod:`gpucomm.story` turns the records into words.

Layout of one segment (little-endian int64 words, then a string table)::

    header  [magic, pid, strings (count interned), 0]
    ring    RING slots of [entry, seq, collective, dtype, count, op, root, group, call site,
                           entered at, ended at]       (call number ``entry`` in slot entry % RING)
    strings STRINGS entries of STRING_BYTES, NUL-padded UTF-8; id 0 is the empty string

Collective, dtype, op, group and call site are ids into the string table, interned once per
process. Times are ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock for every process of a
host). "ended at" is 0 while the call runs, the time it completed, or minus the time it failed.
``entry`` counts this rank's calls from 1 (0: a slot never written); a reader copies the segment
and orders the slots by it. A call is one write of its slot and one store of its end time: a
reader racing the writer may see a torn slot for one reading, which a diagnosis can afford and
which keeps the hot path free of any ordering.

One record per process and root communicator: subgroups write into their parent's record, with
their own group id, so that a rank of the world group can see that a peer waits in a subgroup.
Ranks are ranks of the node: all ranks on one host (split by ``GPUCOMM_LOCAL_WORLD_SIZE``
where it pretends smaller nodes); where ranks span hosts each rank keeps a record of its own,
and its peers are named by what the store tells (:mod:`gpucomm.liveness`).

The caller's file:line is the first frame outside gpucomm and torch.distributed, found by
walking ``sys._getframe`` with the verdict on each code object cached.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import sys
import time
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpucomm.transport import open_workspace

if TYPE_CHECKING:
    from gpucomm.work import Work

__all__ = ["FlightRecord", "FlightLog", "Call", "RankRecord"]

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
_SLOT_BYTES = _SLOT.size
_RING_MASK = RING - 1  # RING is a power of two
_UNSEEN = object()

# Frames in these directories are gpucomm's or torch.distributed's own, not the caller's.
_INTERNAL_DIRS = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.distributed.__file__)) + os.sep,
)


@dataclasses.dataclass(frozen=True)
class Call:
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
    calls: list[Call]  # oldest first, at most RING

    @property
    def current(self) -> Call | None:
        """The call it is in now, or None."""
        return self.calls[-1] if self.calls and self.calls[-1].running else None

    @property
    def last_completed(self) -> Call | None:
        return next((c for c in reversed(self.calls) if c.completed), None)

    def find(self, group: str, seq: int) -> Call | None:
        """Its call number ``seq`` of ``group``, if still in the ring."""
        return next((c for c in reversed(self.calls) if c.seq == seq and c.group == group), None)

    @property
    def alive(self) -> bool:
        if self.pid <= 0:  # a segment not written yet: no process to ask about
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class FlightRecord:
    """The segments of one root communicator's node: this rank's to write, its peers' to read.

    Collective: every rank of the root communicator opens it, with the communicator's store,
    prefix, global ranks, its own rank in it, ranks per node, whether every rank is on this host
    and the timeout of the handshake.
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
        self.ranks = node  # global ranks on this node, in the order of the segments
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
        self._mine = memoryview(self.workspace.data(node.index(me)).bytes.numpy())
        self._views = {g: self.workspace.data(i).bytes for i, g in enumerate(node)}
        self._interned: dict[str, int] = {"": 0}
        self.entries = 0  # calls entered so far, by every communicator writing here
        self.mine = self._mine  # what FlightLog writes into
        _HEADER.pack_into(self._mine, 0, MAGIC, os.getpid(), 1, 0)

    def close(self) -> None:
        """Unmap every segment. Idempotent."""
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

    def end(self, at: int, ok: bool = True) -> None:
        """Stamp the call at slot offset ``at`` as completed (or failed) now."""
        now = time.monotonic_ns()
        _WORD.pack_into(self._mine, at + _ENDED_AT, now if ok else -now)

    def running(self, at: int) -> bool:
        """Whether the call at slot offset ``at`` has not ended yet."""
        return _WORD.unpack_from(self._mine, at + _ENDED_AT)[0] == 0

    # -- reading ----------------------------------------------------------------------------------
    def has(self, rank: int) -> bool:
        return rank in self._views

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
            Call(seq, text(name), text(dtype), n, text(op), root, text(group), text(site), entered, ended)
            for entry, seq, name, dtype, n, op, root, group, site, entered, ended in slots
            if entry > 0
        ]
        return RankRecord(rank, pid, calls)


def _string(raw: bytes, ident: int) -> str:
    at = _STRING_TABLE_AT + ident * STRING_BYTES
    return raw[at : at + STRING_BYTES].split(b"\0", 1)[0].decode("utf-8", "replace")


class FlightLog:
    """What one communicator writes into its root's :class:`FlightRecord`: the two hooks of
    ``Communicator._run`` (:meth:`entered`, :meth:`completed`) and the caller's call site.

    Args:
        record: the root communicator's record.
        group: this communicator's label ("world" for a root over every rank, else its ranks).
    """

    def __init__(self, record: FlightRecord, group: str) -> None:
        self.record = record
        self.group = group
        self._group_id = record.intern(group)
        self._mine = record.mine
        # Keyed by id(code): a code object's own hash covers its bytecode and constants, and costs
        # microseconds per call for a function the size of Communicator._run. _codes keeps each
        # code object alive, so that its id cannot be reused by another.
        # id(code) -> None for gpucomm's and torch.distributed's own code, else the call sites
        # seen in it: instruction offset -> interned "file:line in function".
        self._codes: list[types.CodeType] = []
        self._sites: dict[int, dict[int, int] | None] = {}
        # (collective, wire dtype, op, user dtype) -> _kind()
        self._kinds: dict[tuple[str, object, object, object], tuple[int, int, int, int, int]] = {}
        self._last = -1  # slot offset of the last call entered
        # Asynchronous calls not complete when they returned: (slot, entry number, Work).
        self._pending: list[tuple[int, int, Work]] = []

    def entered(self, seq: int, fn: str, tensor: torch.Tensor | None, fields: dict[str, object]) -> int:
        """Record call ``seq`` of ``fn`` entered now; returns its slot for :meth:`completed`.
        Its root is ``fields["root"]`` (a send's or receive's peer is not recorded).

        The hot path (its cost is measured in docs/reliability.md): a walk up the frames with a
        cached verdict per code object, starting above ``Communicator._run`` and the collective
        method that called it; the call site looked up by instruction offset (a frame's line
        number is computed from its line table on every access); one write of the slot.
        """
        frame = sys._getframe(3)
        codes = self._sites
        while frame is not None:
            sites = codes.get(id(frame.f_code), _UNSEEN)
            if sites is _UNSEEN:
                sites = self._classify(frame.f_code)
            if sites is not None:
                break
            frame = frame.f_back
        site = 0 if frame is None else sites.get(frame.f_lasti)  # type: ignore[union-attr]
        if site is None:
            site = self._site(frame)  # type: ignore[arg-type]
        dtype = None if tensor is None else tensor.dtype
        key = (fn, dtype, fields.get("op"), fields.get("user_dtype"))
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = self._kind(*key)
        if self._pending:
            self._sweep()
        record = self.record
        entry = record.entries = record.entries + 1
        at = _RING_AT + (entry & _RING_MASK) * _SLOT_BYTES
        _SLOT.pack_into(
            self._mine, at, entry, seq, kind[0], kind[1], 0 if tensor is None else tensor.numel() * kind[3] // kind[4],
            kind[2], fields.get("root", -1), self._group_id, site, time.monotonic_ns(), 0,  # type: ignore[operator]
        )
        self._last = at
        return at

    def completed(self, at: int) -> None:
        _WORD.pack_into(self._mine, at + _ENDED_AT, time.monotonic_ns())

    def completes_with(self, at: int, work: Work) -> None:
        """An asynchronous call returned ``work``. The host paths have run it already (stamped
        now); a GPU call is stamped when the host has queued it, as a blocking one is (its end
        event belongs to the watchdog); a gloo or send/recv one is stamped when a later call of
        this communicator finds it complete (an upper bound of its end)."""
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

    def failed(self) -> None:
        """The last call entered ended in an error (called where the error is translated)."""
        if self._last >= 0 and self.record.running(self._last):
            self.record.end(self._last, ok=False)

    def _kind(self, fn: str, dtype: torch.dtype | None, op: object, user_dtype: object) -> tuple[int, int, int, int, int]:
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

    def _classify(self, code: types.CodeType) -> dict[int, int] | None:
        """First sight of ``code``: None if it is gpucomm's or torch.distributed's own."""
        self._codes.append(code)
        sites = self._sites[id(code)] = None if code.co_filename.startswith(_INTERNAL_DIRS) else {}
        return sites

    def _site(self, frame: types.FrameType) -> int:
        """Intern a call site seen for the first time: ``file.py:line in function``."""
        code = frame.f_code
        where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
        site = self._sites[id(code)][frame.f_lasti] = self.record.intern(where)  # type: ignore[index]
        return site


def group_label(global_ranks: Sequence[int], root: bool, world_size: int) -> str:
    """How a communicator is named in a record: "world" for a root over ranks 0..n-1."""
    ranks = list(global_ranks)
    if root and ranks == list(range(world_size)):
        return "world"
    return f"group {ranks}"
