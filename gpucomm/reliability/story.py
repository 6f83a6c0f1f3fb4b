"""The story of a hang, in words: who waits for whom, and what each rank of the node is doing.

Built from the node's flight records (:mod:`gpucomm.reliability.flight`) off the hot path: when an error is
raised (:func:`timeout_story`, :func:`mismatch_story`), when :func:`gpucomm.status` is called,
and when the status signal arrives (:class:`StatusSignal`).
"""

from __future__ import annotations

import dataclasses
import datetime
import signal
import sys
import threading
import time
from collections.abc import Sequence

from gpucomm import log
from gpucomm.reliability.flight import CallRecord, FlightLog, RankRecord
from gpucomm.roles import Ranks

__all__ = ["timeout_story", "mismatch_story", "NodeStatus", "RankStatus", "node_status", "StatusSignal"]


def _ago(ns: int, now: int) -> str:
    return f"{max(0, now - abs(ns)) / 1e9:.1f} s"


def describe_call(call: CallRecord) -> str:
    """``all_reduce #6 (float32 x 4, op SUM) of the world group, called at train.py:41 in step``.

    A subgroup reads ``of group [2, 3]``, its global ranks.
    """
    parts = []
    if call.dtype:
        parts.append(f"{call.dtype} x {call.count}")
    if call.op:
        parts.append(f"op {call.op}")
    if call.root >= 0:
        parts.append(f"root {call.root}")
    detail = f" ({', '.join(parts)})" if parts else ""
    return f"{call.name} #{call.seq}{detail} of {_group(call.group)}, called at {call.site or '?'}"


def _group(label: str) -> str:
    return "the world group" if label == "world" else label


def _last(record: RankRecord, now: int) -> str:
    last = record.last_completed
    if last is None:
        return "it has completed no collective yet"
    return f"it last completed {describe_call(last)}, {_ago(last.ended_ns, now)} ago"


def _doing(record: RankRecord, now: int) -> str:
    """What a rank is doing now, and what it last completed."""
    gone = "" if record.alive else f" (its process, pid {record.pid}, has exited)"
    current = record.current
    if current is not None:
        state = f"is in {describe_call(current)}, for {_ago(current.entered_ns, now)}"
    elif record.calls and record.calls[-1].ended_ns < 0:
        failed = record.calls[-1]
        state = f"is in no collective (its {describe_call(failed)} failed {_ago(failed.ended_ns, now)} ago)"
    else:
        state = "is in no collective"
    return f"{state}{gone}; {_last(record, now)}"


def timeout_story(flight: FlightLog, comm: Ranks, missing: Sequence[int]) -> str:
    """What each missing rank (ranks of ``comm``) is doing, then what the waiting rank itself is in.

    A missing rank's line comes from its flight record where it is on this node.
    """
    record, now = flight.record, time.monotonic_ns()
    lines = []
    for r in missing:
        g = comm.global_ranks[r] if 0 <= r < comm.world_size else r
        seen = record.read(g)
        who = f"rank {r}" if g == r else f"rank {r} (global rank {g})"
        if seen is None:
            lines.append(f"  {who} is on another node: no flight record here (named by the store-based check)")
        else:
            lines.append(f"  {who} {_doing(seen, now)}")
    me = record.read(comm.global_ranks[comm.rank])
    mine = me.current if me is not None else None
    if mine is None and me is not None and me.calls:
        mine = me.calls[-1]  # the call that failed (already stamped by another teller)
    if mine is not None:
        lines.append(f"  rank {comm.rank} (this rank) is in {describe_call(mine)}, for {_ago(mine.entered_ns, now)}")
    return "\n".join(lines)


_COLUMNS = ("collective", "dtype", "count", "op", "root", "call site")


def _row(call: CallRecord | None) -> list[str]:
    if call is None:
        return ["(no record)", "", "", "", "", ""]
    return [
        call.name,
        call.dtype or "-",
        str(call.count) if call.dtype else "-",
        call.op or "-",
        str(call.root) if call.root >= 0 else "-",
        call.site or "?",
    ]


def mismatch_story(flight: FlightLog, comm: Ranks, seq: int, peers: Sequence[int]) -> str:
    """Both calls of a mismatch side by side: this rank's call ``seq`` and each peer's."""
    record = flight.record
    rows = [[f"rank {comm.rank}", *_row(_find(record.read(comm.global_ranks[comm.rank]), flight.group, seq))]]
    for r in peers:
        seen = record.read(comm.global_ranks[r]) if 0 <= r < comm.world_size else None
        if seen is None:
            rows.append([f"rank {r}", "(on another node: no flight record here)", "", "", "", "", ""])
        else:
            rows.append([f"rank {r}", *_row(_find(seen, flight.group, seq))])
    table = _table(["", *_COLUMNS], rows)
    return f"  the calls diverged at call #{seq} of {_group(flight.group)}:\n" + "\n".join(
        "    " + line for line in table
    )


def _find(record: RankRecord | None, group: str, seq: int) -> CallRecord | None:
    return None if record is None else record.find(group, seq)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


@dataclasses.dataclass(frozen=True)
class RankStatus:
    """One rank of the node: the call it is in (None: none), and the last it completed."""

    rank: int  # global rank
    pid: int
    alive: bool
    current: CallRecord | None
    last_completed: CallRecord | None
    failed: CallRecord | None  # its latest call, if that ended in an error


@dataclasses.dataclass(frozen=True)
class NodeStatus:
    """What :func:`gpucomm.status` returns: every rank of the caller's node.

    ``str()`` is the table the status signal prints: one row per rank, columns separated by two
    spaces or more.
    """

    rank: int  # the global rank that read it
    at_ns: int  # time.monotonic_ns() of the reading
    ranks: list[RankStatus]

    def __str__(self) -> str:
        header = ["rank", "pid", "in now", "for", "last completed", "ago"]
        rows = []
        for r in self.ranks:
            now, since = "-", "-"
            if r.current is not None:
                now, since = _brief(r.current), _ago(r.current.entered_ns, self.at_ns)
            elif r.failed is not None:
                now = f"- (failed in {_brief(r.failed)} {_ago(r.failed.ended_ns, self.at_ns)} ago)"
            last = "-" if r.last_completed is None else _brief(r.last_completed)
            ago = "-" if r.last_completed is None else _ago(r.last_completed.ended_ns, self.at_ns)
            rows.append([str(r.rank), str(r.pid) + ("" if r.alive else " (exited)"), now, since, last, ago])
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        title = f"gpucomm status of the node of rank {self.rank} ({len(self.ranks)} ranks), {stamp}"
        return "\n".join([title, *_table(header, rows)])


def _brief(call: CallRecord) -> str:
    return f"{call.name} #{call.seq} {call.group} at {call.site or '?'}"


def node_status(flight: FlightLog, rank: int) -> NodeStatus:
    """Every rank of the node of ``flight``'s record, read now; ``rank`` is the caller's global rank."""
    record = flight.record
    ranks = []
    for g in record.ranks:
        seen = record.read(g)
        if seen is not None:
            failed = seen.calls[-1] if seen.calls and seen.calls[-1].ended_ns < 0 else None
            ranks.append(RankStatus(g, seen.pid, seen.alive, seen.current, seen.last_completed, failed))
    return NodeStatus(rank, time.monotonic_ns(), ranks)


class StatusSignal:
    """Print the node's status to stderr when ``signum`` arrives (``GPUCOMM_STATUS_SIGNAL``).

    Python runs a signal handler in the main thread between two bytecodes: a rank waiting on
    the host (the shared-memory path, the interpreter) prints at once; one blocked inside a C++
    call (gloo) prints when the call returns or times out.
    """

    def __init__(self, flight: FlightLog, rank: int, signum: int) -> None:
        self.signum = signum
        self._flight = flight
        self._rank = rank
        self._previous: object = None
        self.installed = False
        if threading.current_thread() is not threading.main_thread():
            log.logger.warning(
                f"gpucomm[rank {rank}]: GPUCOMM_STATUS_SIGNAL={signal.Signals(signum).name} is not installed: "
                "init_process_group ran outside the main thread, and Python installs handlers only from it"
            )
            return
        self._previous = signal.signal(signum, self._handle)
        self.installed = True

    def _handle(self, signum: int, frame: object) -> None:
        sys.stderr.write(f"{node_status(self._flight, self._rank)}\n")
        sys.stderr.flush()

    def close(self) -> None:
        """Put the previous handler back (only if ours is still the one installed)."""
        if self.installed and threading.current_thread() is threading.main_thread():
            if signal.getsignal(self.signum) == self._handle:
                signal.signal(self.signum, self._previous)  # type: ignore[arg-type]
            self.installed = False
