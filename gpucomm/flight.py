"""The node-local flight record: each rank's last calls, in memory the ranks of its node can read.

Every rank of a node keeps a small POSIX shared-memory segment, opened with the communicator
like the shared-memory workspace (gpucomm.transport.shm: names published through the store
under the communicator's prefix, checked by the peers, unlinked once every peer has mapped
them), whatever path serves the calls. A waiting rank reads what its peers are doing without
sending anything; :mod:`gpucomm.story` turns the records into words.

Layout of one segment (little-endian int64 words, then a string table)::

    header  [magic, pid, entries (calls entered so far), strings (count interned)]
    ring    RING slots of [seq, collective, dtype, count, op, root, group, call site,
                           entered at, ended at]       (slot = entries % RING)
    strings STRINGS entries of STRING_BYTES, NUL-padded UTF-8; id 0 is the empty string

Collective, dtype, op, group and call site are ids into the string table, interned once per
process. Times are ``time.monotonic_ns()`` (CLOCK_MONOTONIC, one clock for every process of a
host). "ended at" is 0 while the call runs, the time it completed, or minus the time it failed.
A writer fills a slot, then publishes it by advancing ``entries``; a reader copies the segment
and takes the ring below ``entries``: a torn slot (a reader racing the writer) shows a wrong
call for one reading, which is acceptable for a diagnosis and costs the hot path nothing.

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
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpucomm.transport import open_workspace

if TYPE_CHECKING:
    from gpucomm.communicator import Communicator
    from gpucomm.work import Work

__all__ = ["FlightRecord", "FlightLog", "Call", "RankRecord"]

MAGIC = 0x6770_6366_6C69_6768  # "gpcfligh"
RING = 64  # calls kept per rank: enough to see a pattern, small enough to copy in a read
STRINGS = 256  # interned strings (call sites, names) per process; later ones show as "?"
STRING_BYTES = 128
_HEADER = struct.Struct("<4q")
_SLOT = struct.Struct("<10q")
_WORD = struct.Struct("<q")
_ENTRIES_AT = 16  # byte offset of the header's "entries" word
_STRINGS_AT_WORD = 24
_RING_AT = 64
_STRING_TABLE_AT = _RING_AT + RING * _SLOT.size
SEGMENT_BYTES = _STRING_TABLE_AT + STRINGS * STRING_BYTES
_ENDED_AT = 9 * 8  # byte offset of "ended at" in a slot

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
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class FlightRecord:
    """The segments of one root communicator's node: this rank's to write, its peers' to read.

    Args:
        comm: the root communicator (collective: every rank of it must open the record).
    """

    def __init__(self, comm: Communicator) -> None:
        me = comm.global_ranks[comm.rank]
        if comm._liveness.one_host():
            per_node = max(1, comm.local_world_size)
            node = [g for g in comm.global_ranks if g // per_node == me // per_node]
        else:  # ranks on several hosts: which share this one is not known here; keep to ourselves
            node = [me]
        self.ranks = node  # global ranks on this node, in the order of the segments
        self.workspace = open_workspace(
            "shm",
            store=comm.store,
            prefix=f"{comm.prefix}flight/n{node[0]}/",
            rank=node.index(me),
            world_size=len(node),
            data_bytes=SEGMENT_BYTES,
            flag_count=0,
            device=torch.device("cpu"),
            timeout=comm.timeout,
        )
        self._mine = memoryview(self.workspace.data(node.index(me)).bytes.numpy())
        self._views = {g: self.workspace.data(i).bytes for i, g in enumerate(node)}
        self._interned: dict[str, int] = {"": 0}
        self.entries = 0
        _HEADER.pack_into(self._mine, 0, MAGIC, os.getpid(), 0, 1)

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

    def write(self, seq: int, name: int, dtype: int, count: int, op: int, root: int, group: int, site: int) -> int:
        """Record a call entered now; returns the byte offset of its slot (for :meth:`end`)."""
        n = self.entries
        at = _RING_AT + n % RING * _SLOT.size
        _SLOT.pack_into(self._mine, at, seq, name, dtype, count, op, root, group, site, time.monotonic_ns(), 0)
        self.entries = n + 1
        _WORD.pack_into(self._mine, _ENTRIES_AT, n + 1)
        return at

    def end(self, at: int, ok: bool = True) -> None:
        """Stamp the call at slot offset ``at`` as completed (or failed) now."""
        now = time.monotonic_ns()
        _WORD.pack_into(self._mine, at + _ENDED_AT, now if ok else -now)

    # -- reading ----------------------------------------------------------------------------------
    def has(self, rank: int) -> bool:
        return rank in self._views

    def read(self, rank: int) -> RankRecord | None:
        """Global rank ``rank``'s record as it is now, or None if it is not on this node."""
        view = self._views.get(rank)
        if view is None:
            return None
        raw = view.numpy().tobytes()  # one copy: every field below comes from the same moment
        magic, pid, entries, count = _HEADER.unpack_from(raw, 0)
        if magic != MAGIC:
            return RankRecord(rank, 0, [])
        strings = [_string(raw, i) for i in range(min(count, STRINGS))]

        def text(i: int) -> str:
            return strings[i] if 0 <= i < len(strings) else "?"

        calls = []
        for k in range(max(0, entries - RING), entries):
            seq, name, dtype, n, op, root, group, site, entered, ended = _SLOT.unpack_from(raw, _RING_AT + k % RING * _SLOT.size)
            calls.append(Call(seq, text(name), text(dtype), n, text(op), root, text(group), text(site), entered, ended))
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
        self._internal: dict[object, bool] = {}  # code object -> inside gpucomm / torch.distributed
        self._sites: dict[tuple[object, int], int] = {}  # (code, line) -> interned id
        self._kinds: dict[tuple[str, object, object, object], tuple[int, int, int, int, int]] = {}
        self._open = -1  # slot offset of the last call entered and not ended
        # Asynchronous calls not complete when they returned: (slot, entry number, Work).
        self._pending: list[tuple[int, int, Work]] = []

    def entered(self, seq: int, fn: str, tensor: torch.Tensor | None, fields: dict[str, object]) -> int:
        """Record call ``seq`` of ``fn`` entered now; returns its slot for :meth:`completed`."""
        user_dtype, op, root = fields.get("user_dtype"), fields.get("op"), fields.get("root", fields.get("peer"))
        dtype = None if tensor is None else tensor.dtype
        key = (fn, dtype, user_dtype, op)
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = self._kind(fn, dtype, user_dtype, op)
        name, dtype_id, op_id, wire_size, user_size = kind
        if self._pending:
            self._sweep()
        count = 0 if tensor is None else tensor.numel() * wire_size // user_size
        at = self.record.write(seq, name, dtype_id, count, op_id, -1 if root is None else root, self._group_id, self._site())  # type: ignore[arg-type]
        self._open = at
        return at

    def completed(self, at: int) -> None:
        self.record.end(at)
        if self._open == at:
            self._open = -1

    def completes_with(self, at: int, work: Work) -> None:
        """An asynchronous call returned ``work``. The host paths have run it already (stamped
        now); a GPU call is stamped when the host has queued it, as a blocking one is (its end
        event belongs to the watchdog); a gloo or send/recv one is stamped when a later call of
        this communicator finds it complete (an upper bound of its end)."""
        if work.side_stream is not None or work.is_completed():
            self.completed(at)
        else:
            self._pending.append((at, self.record.entries - 1, work))

    def _sweep(self) -> None:
        still = []
        for at, entry, work in self._pending:
            if self.record.entries - entry > RING:
                continue  # its slot holds a later call now
            if work.is_completed():
                self.record.end(at)
            else:
                still.append((at, entry, work))
        self._pending = still
        if self._open >= 0 and all(at != self._open for at, _, _ in still):
            self._open = -1

    def failed(self) -> None:
        """The last call entered ended in an error (called where the error is translated)."""
        if self._open >= 0:
            self.record.end(self._open, ok=False)
            self._open = -1

    def _kind(self, fn: str, dtype: torch.dtype | None, user_dtype: object, op: object) -> tuple[int, int, int, int, int]:
        intern = self.record.intern
        wire_size = 1 if dtype is None else dtype.itemsize
        user_size = wire_size
        dtype_name = "" if dtype is None else str(dtype).removeprefix("torch.")
        if isinstance(user_dtype, str):
            user = getattr(torch, user_dtype, None)
            if isinstance(user, torch.dtype):
                user_size, dtype_name = user.itemsize, user_dtype
        return intern(fn), intern(dtype_name), intern("" if op is None else str(op)), wire_size, user_size

    def _site(self) -> int:
        """The interned file:line of the first frame outside gpucomm and torch.distributed."""
        frame = sys._getframe(2)
        internal = self._internal
        while frame is not None:
            code = frame.f_code
            inside = internal.get(code)
            if inside is None:
                inside = internal[code] = code.co_filename.startswith(_INTERNAL_DIRS)
            if not inside:
                break
            frame = frame.f_back
        if frame is None:
            return 0
        key = (code, frame.f_lineno)
        site = self._sites.get(key)
        if site is None:
            where = f"{os.path.basename(code.co_filename)}:{frame.f_lineno} in {code.co_name}"
            site = self._sites[key] = self.record.intern(where)
        return site


def group_label(global_ranks: Sequence[int], root: bool, world_size: int) -> str:
    """How a communicator is named in a record: "world" for a root over ranks 0..n-1."""
    ranks = list(global_ranks)
    if root and ranks == list(range(world_size)):
        return "world"
    return f"group {ranks}"
