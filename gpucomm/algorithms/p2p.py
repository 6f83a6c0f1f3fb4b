"""send/recv on the workspace: one mailbox per (sender, receiver) pair, slots plus two counters.

send/recv are not collective, so the shared epoch counter cannot order them. Each ordered pair
(s, r) has instead:

- in s's workspace, an outbox for r: ``SLOTS`` slots, each a 4-int64 header
  ``(tag, message bytes, offset of this piece, bytes of this piece)`` and a payload area;
- among r's "data ready" flags, the one of s: how many pieces s has posted to r;
- among s's "consumed" flags, the one of r: how many pieces r has taken.

The sender puts piece k of its stream to r into slot k % SLOTS once r has consumed piece
k - SLOTS (acquire of "consumed" before the write: r's reads of the slot are done), writes
header and payload, then stores k + 1 into "data ready" with release. The receiver takes piece
k once "data ready" > k (acquire), copies the payload out, and stores k + 1 into "consumed"
with release. Counters only grow; nothing else is shared, so any pair may talk at any time and
up to SLOTS pieces per pair are in flight.

Messages larger than a payload go as consecutive pieces of the pair's stream. The receiver
matches a message to the oldest posted recv with the same source (or any source) and tag when
its first piece arrives. A message nobody waits for yet is drained into a private buffer (the
"unexpected" queue), so that it never blocks the messages behind it: different tags are kept
apart and may be received in any order, while messages with the same (source, tag) arrive in
the order they were sent.

Nothing runs in the background: pieces move whenever this rank is in any gpucomm wait (a recv, a
send's ``wait()``, a collective's sync), so a ring of isend + recv completes. Every blocking
wait has the communicator's timeout, counted from the last piece that moved, and raises
:class:`CommTimeoutError` naming the peer(s) it waited for.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch

from gpucomm.errors import CommMismatchError, CommTimeoutError, UnsupportedError
from gpucomm.ops.contract import Region
from gpucomm.roles import NodeWorkspace
from gpucomm.work import Work

__all__ = ["Mailboxes", "MailEngine", "SLOTS"]

SLOTS = 2  # pieces in flight per ordered pair
_HEADER_INTS = 4
_HEADER_BYTES = _HEADER_INTS * 8
_SPIN_POLLS = 50  # busy polls before a blocked wait starts to sleep
_MAX_SLEEP_S = 1e-3


class _Send:
    def __init__(self, region: Region, tag: int) -> None:
        self.region = region
        self.tag = tag
        self.sent = 0  # bytes staged so far
        self.done = False


class _Recv:
    def __init__(self, region: Region, src: int | None, tag: int) -> None:
        self.region = region
        self.src = src
        self.tag = tag
        self.source: int | None = None
        self.done = False


class _Message:
    """A message whose first piece has arrived: where its bytes go, and how many came."""

    def __init__(self, src: int, tag: int, nbytes: int, target: Region, request: _Recv | None) -> None:
        self.src = src
        self.tag = tag
        self.nbytes = nbytes
        self.target = target
        self.request = request  # None: unexpected, buffered in target until a recv matches
        self.received = 0

    @property
    def complete(self) -> bool:
        return self.received == self.nbytes


class _Request:
    """What ``Work`` waits on: drives the mailboxes until ``item`` is done."""

    def __init__(self, mail: Mailboxes, item: _Send | _Recv, peers: list[int], what: str) -> None:
        self.mail = mail
        self.item = item
        self.peers = peers
        self.what = what

    def is_completed(self) -> bool:
        if not self.item.done:
            self.mail.progress()
        return self.item.done

    def wait(self) -> None:
        self.mail.block_until(lambda: self.item.done, self.peers, self.what)


@runtime_checkable
class MailEngine(NodeWorkspace, Protocol):
    """What the mailboxes read of their engine (:class:`gpucomm.workspace.engine.Engine`).

    The node's workspace, and where each rank's send/recv area lies in it.
    """

    def mailbox(self, peer: int, offset: int, nbytes: int) -> Region: ...


class Mailboxes:
    """The send/recv state of one engine (ranks are the engine's local ranks)."""

    def __init__(self, engine: MailEngine, ready_flags: int, done_flags: int) -> None:
        self.engine = engine
        self.ready_flags = ready_flags  # index of my first "data ready" flag: pieces each peer posted to me
        self.done_flags = done_flags  # index of my first "consumed" flag: pieces each peer took from me
        P = engine.world_size
        self.headers_bytes = -(-P * SLOTS * _HEADER_BYTES // 256) * 256
        self.payload = (engine.p2p_bytes - self.headers_bytes) // (P * SLOTS) // 16 * 16
        if P > 1 and self.payload < 16:
            raise UnsupportedError(
                f"gpucomm: GPUCOMM_WORKSPACE_BYTES is too small for send/recv among {P} ranks "
                f"(mailbox payload {self.payload} bytes)"
            )
        self.posted = [0] * P  # pieces I posted to each peer
        self.consumed = [0] * P  # pieces I took from each peer
        self.queues: list[collections.deque[_Send]] = [collections.deque() for _ in range(P)]
        self.inbound: list[_Message | None] = [None] * P  # message being received from each peer
        self.recvs: list[_Recv] = []  # posted, not yet matched, in post order
        self.unexpected: list[_Message] = []  # arrived (maybe partly), not yet matched
        # Two threads move pieces: the caller's (posting, and waiting on a send or receive) and the
        # communicator's progress thread (its collectives' waits move them, so that a peer blocked
        # in a send is not left waiting). One at a time: a piece taken twice or a slot posted twice
        # corrupts the message (tests/comm/test_async.py, send/recv beside asynchronous collectives).
        self._lock = threading.RLock()

    # -- layout ---------------------------------------------------------------------------------
    def _header(self, owner: int, dst: int, slot: int) -> Region:
        return self.engine.mailbox(owner, ((dst * SLOTS) + slot) * _HEADER_BYTES, _HEADER_BYTES)

    def _payload(self, owner: int, dst: int, slot: int, nbytes: int) -> Region:
        return self.engine.mailbox(owner, self.headers_bytes + (dst * SLOTS + slot) * self.payload, nbytes)

    def _flag(self, owner: int, first: int, writer: int) -> Region:
        return self.engine.workspace.flag(owner, first + writer)

    def _counters(self, first: int) -> list[int]:
        """A snapshot of my P flags from index ``first`` (plain loads: a hint, acquired before use)."""
        return self.engine.workspace.flags(self.engine.rank, first, self.engine.world_size).view(torch.int64).tolist()

    def _acquire(self, first: int, writer: int, target: int) -> bool:
        """Acquire-load my flag from ``writer``; True if it has reached ``target``."""
        flag = self._flag(self.engine.rank, first, writer)
        return not self.engine.kernels.wait([flag], target, 0.0)

    # -- posting --------------------------------------------------------------------------------
    def isend(self, region: Region, dst: int, tag: int) -> Work:
        item = _Send(region, tag)
        with self._lock:
            self.queues[dst].append(item)
            self.progress()
        return Work([_Request(self, item, [dst], "send")])

    def irecv(self, region: Region, src: int | None, tag: int) -> Work:
        item = _Recv(region, src, tag)
        with self._lock:
            message = next((m for m in self.unexpected if _matches(item, m)), None)
            if message is None:
                self.recvs.append(item)
            else:
                self.unexpected.remove(message)
                self._bind(message, item)
            self.progress()
        peers = [p for p in range(self.engine.world_size) if p != self.engine.rank] if src is None else [src]
        request = _Request(self, item, peers, "recv")
        work = Work([request], finish=lambda: setattr(work, "source", self.engine.members[item.source]))
        return work

    def busy(self) -> bool:
        """Whether sends or receives of this rank are waiting for pieces to move."""
        return bool(self.recvs) or any(self.queues) or any(m is not None for m in self.inbound)

    # -- moving pieces --------------------------------------------------------------------------
    def progress(self) -> bool:
        """Post what the slots allow and take what has arrived, without blocking; True if a piece moved."""
        with self._lock:
            return self._progress()

    def _progress(self) -> bool:
        me = self.engine.rank
        moved = False
        if any(self.queues):
            done = self._counters(self.done_flags)
            for dst, queue in enumerate(self.queues):
                while queue and self._slot_free(dst, done[dst]):
                    self._post(dst, queue)
                    moved = True
        ready = self._counters(self.ready_flags)
        for src in range(self.engine.world_size):
            while (
                src != me
                and ready[src] > self.consumed[src]
                and self._acquire(self.ready_flags, src, self.consumed[src] + 1)
            ):
                self._take(src)
                moved = True
        return moved

    def _slot_free(self, dst: int, done_hint: int) -> bool:
        needed = self.posted[dst] - SLOTS + 1  # the reader must have taken piece posted - SLOTS
        return needed <= 0 or (done_hint >= needed and self._acquire(self.done_flags, dst, needed))

    def _post(self, dst: int, queue: collections.deque[_Send]) -> None:
        engine, item = self.engine, queue[0]
        slot = self.posted[dst] % SLOTS
        part = item.region.sub(item.sent, min(self.payload, item.region.nbytes - item.sent))
        engine.kernels.copy(self._payload(engine.rank, dst, slot, part.nbytes), part)
        header = torch.tensor([item.tag, item.region.nbytes, item.sent, part.nbytes], dtype=torch.int64)
        self._header(engine.rank, dst, slot).view(torch.int64).copy_(header.to(engine.device))
        self.posted[dst] += 1
        engine.kernels.signal([self._flag(dst, self.ready_flags, engine.rank)], self.posted[dst])
        item.sent += part.nbytes
        if item.sent == item.region.nbytes:
            item.done = True
            queue.popleft()

    def _take(self, src: int) -> None:
        engine = self.engine
        slot = self.consumed[src] % SLOTS
        tag, total, offset, nbytes = self._header(src, engine.rank, slot).view(torch.int64).tolist()
        message = self.inbound[src]
        if message is None:
            message = self._arrive(src, tag, total)
        if nbytes:
            engine.kernels.copy(message.target.sub(offset, nbytes), self._payload(src, engine.rank, slot, nbytes))
        message.received += nbytes
        self.consumed[src] += 1
        engine.kernels.signal([self._flag(src, self.done_flags, engine.rank)], self.consumed[src])
        self.inbound[src] = None if message.complete else message
        if message.complete and message.request is not None:
            self._finish(message)

    def _arrive(self, src: int, tag: int, nbytes: int) -> _Message:
        """The first piece of a message: match it to a posted recv, or buffer it."""
        request = next((r for r in self.recvs if r.tag == tag and r.src in (None, src)), None)
        if request is None:
            buffer = Region.of(torch.empty(nbytes, dtype=torch.uint8, device=self.engine.device))
            message = _Message(src, tag, nbytes, buffer, None)
            self.unexpected.append(message)
            return message
        self.recvs.remove(request)
        self._check_size(request, src, tag, nbytes)
        return _Message(src, tag, nbytes, request.region, request)

    def _bind(self, message: _Message, request: _Recv) -> None:
        """A posted recv takes a buffered message (complete or still arriving)."""
        self._check_size(request, message.src, message.tag, message.nbytes)
        message.request = request
        if message.complete:
            self._finish(message)

    def _finish(self, message: _Message) -> None:
        request = message.request
        if message.target.addr != request.region.addr and message.nbytes:
            self.engine.kernels.copy(request.region, message.target)
        request.source = message.src
        request.done = True

    def _check_size(self, request: _Recv, src: int, tag: int, nbytes: int) -> None:
        if request.region.nbytes != nbytes:
            members = self.engine.members
            raise CommMismatchError(
                f"gpucomm.recv: rank {members[self.engine.rank]} posted a {request.region.nbytes}-byte receive "
                f"for tag {tag}, but rank {members[src]} sent {nbytes} bytes"
            )

    def block_until(self, done: Callable[[], bool], peers: list[int], what: str) -> None:
        """Move pieces until ``done()``; :class:`CommTimeoutError` after ``timeout`` without progress."""
        engine = self.engine
        deadline = time.monotonic() + engine.timeout
        idle = 0
        while not done():
            if self.progress():
                deadline = time.monotonic() + engine.timeout
                idle = 0
                continue
            if time.monotonic() >= deadline:
                raise CommTimeoutError(what, None, engine.comm_rank, [engine.members[p] for p in peers], engine.timeout)
            idle += 1
            if idle > _SPIN_POLLS:
                time.sleep(_MAX_SLEEP_S)


def _matches(request: _Recv, message: _Message) -> bool:
    return message.tag == request.tag and request.src in (None, message.src)
