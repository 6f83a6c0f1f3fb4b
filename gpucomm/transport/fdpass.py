"""File descriptors between the ranks of one node, over Unix sockets (SCM_RIGHTS).

The driver's virtual-memory API shares an allocation as a POSIX file descriptor; a descriptor
means something only inside its process, so it travels the way torch's symmetric memory sends
its own: as ancillary data of a Unix socket (``socket.send_fds`` / ``recv_fds``). Not
``pidfd_getfd``, which containers refuse without ptrace rights.

Each rank listens on an abstract-namespace socket (no file left behind, whatever ends the
process) named from the store prefix, this user and its rank, and publishes in the store its pid
and whether it could listen. Any process on the host that shares the network namespace can see
and connect to those names, so nothing is taken on trust:

- **The name.** A rank that cannot listen (another process holds its name) says so in the
  store, and every rank raises :class:`FdExchangeRefused` naming it, at once.
- **Who listens.** Before sending a descriptor of GPU memory, the sender checks the listener's
  credentials (``SO_PEERCRED``): this user, and the pid the peer published.
- **Who connects.** A connection whose credentials are not a peer's (another user, a pid that
  is none of the peers') is closed unread and the exchange goes on; so is one that sends
  anything but one header naming an expected sender, with that sender's pid, and this exchange's
  tag, and one descriptor. A neighbour that fills the listen backlog with silent connections is
  drained the same way; ``connect`` never blocks (a full backlog is retried to the deadline).
- **Failures.** A rank that gives up (the deadline, a listener that is not its peer) records why
  under one store key that every rank of the exchange polls while it waits: every rank raises the
  same error (:class:`~gpucomm.errors.CommTimeoutError` or :class:`FdExchangeRefused`) within
  its timeout, none waits it out for a peer that already stopped.

A peer in another pid namespace (a container sharing this network namespace but not its pids)
publishes a pid that means nothing here: for it the uid and the header are checked, not the pid.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import select
import socket
import struct
import time

from gpucomm.errors import CommTimeoutError, GpucommError
from gpucomm.transport.processes import pid_space

__all__ = ["FdExchange", "FdExchangeRefused"]

_HEADER = struct.Struct("<ii")  # sender's rank, what the descriptor is (a tag the caller gives)
# How long one wait for progress lasts before the store's failure key is read again: a peer's
# failure reaches every rank within this (plus one store round trip, ~0.1 ms on one host).
_POLL_S = 0.02
# Connections accepted from a process that could be a peer in another pid namespace, kept open
# until their header comes: beyond this many, the oldest is dropped (a flood of silent ones).
_MAX_UNREAD_PER_PEER = 4
_OP = "symmetric heap open"


class FdExchangeRefused(GpucommError):
    """A rank cannot take part in the descriptor exchange safely; every rank raises it, naming that rank.

    Either its socket's name is held by another process, or the process listening under a peer's
    name is not that peer.
    """


def _credentials(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, as the kernel recorded them."""
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


class FdExchange:
    """The Unix sockets of one exchange between ``world_size`` ranks of a node (module docstring).

    Building it is collective: every rank listens and publishes its pid under ``prefix`` in
    ``store`` before any returns. Then call :meth:`share` (or :meth:`send`/:meth:`receive`), in
    the same order on every rank; :meth:`close` at the end.

    Raises:
        FdExchangeRefused: a rank cannot listen under its name (every rank raises it).
        CommTimeoutError: a rank never published (every rank that did raises it at its timeout).
    """

    def __init__(self, store: object, prefix: str, rank: int, world_size: int, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._store = store
        self._keys = f"{prefix}fdpass/"
        self._failed_key = self._keys + "failed"
        self._token = hashlib.sha256(f"{prefix}|{os.getuid()}".encode()).hexdigest()[:24]
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        failure = ""
        try:
            self._listener.bind(self._address(rank))
            self._listener.listen(max(1, world_size))
        except OSError as exc:
            failure = f"rank {rank} cannot listen on {self._address(rank)[1:].decode()}: {exc.strerror}"
            if exc.errno == errno.EADDRINUSE:
                failure += " (another process holds the name)"
        try:
            space = pid_space()
            procs = self._agree(json.dumps({"pid": os.getpid(), "space": space, "failure": failure}))
        except BaseException:
            self._listener.close()
            raise
        first = next((p["failure"] for p in procs if p["failure"]), "")
        if first:
            self._listener.close()
            raise FdExchangeRefused(
                f"gpucomm descriptor exchange: {first}; every rank of the node refuses the exchange"
            )
        # A peer's pid where it means that process here, else None (module docstring).
        self._pids = [p["pid"] if p["space"] == space else None for p in procs]
        self._listener.setblocking(False)

    def _address(self, rank: int) -> bytes:
        return f"\0gpucomm-{self._token}-r{rank}".encode()

    def _agree(self, mine: str) -> list[dict]:
        keys = [f"{self._keys}proc/{r}" for r in range(self.world_size)]
        self._store.set(keys[self.rank], mine.encode())
        try:
            self._store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:
            missing = [r for r, key in enumerate(keys) if not self._store.check([key])]
            if not missing:
                raise
            raise CommTimeoutError(
                _OP, None, self.rank, missing, self.timeout, detail="they never listened for file descriptors"
            ) from exc
        return [json.loads(self._store.get(key).decode()) for key in keys]

    def send(self, peers: list[int], fd: int, tag: int) -> None:
        """Send ``fd`` (with ``tag``) to every rank of ``peers``."""
        self._exchange(peers, fd, tag, [])

    def receive(self, senders: list[int], tag: int) -> dict[int, int]:
        """``{sender: fd}``: the descriptor each rank of ``senders`` sends with ``tag``; the caller closes them."""
        return self._exchange([], -1, tag, senders)

    def share(self, fd: int, tag: int = 0) -> dict[int, int]:
        """Every peer's descriptor for ``tag`` in exchange for this rank's: ``{peer: fd}``."""
        peers = [p for p in range(self.world_size) if p != self.rank]
        return self._exchange(peers, fd, tag, peers)

    def close(self) -> None:
        self._listener.close()

    # The exchange: connect to every peer to send, accept from every sender, in one loop, so that
    # draining this rank's backlog never waits for a peer's (two ranks whose backlogs a neighbour
    # fills both go on).

    def _exchange(self, send_to: list[int], fd: int, tag: int, receive_from: list[int]) -> dict[int, int]:
        deadline = time.monotonic() + self.timeout
        to_send = list(send_to)
        got: dict[int, int] = {}
        unread: list[
            tuple[socket.socket, int | None]
        ] = []  # accepted, header not yet read: (conn, its sender if known)
        try:
            while to_send or len(got) < len(receive_from):
                self._raise_agreed()
                to_send = [peer for peer in to_send if not self._try_send(peer, fd, tag, deadline)]
                if len(got) < len(receive_from):
                    self._accept(receive_from, got, unread)
                    self._read(unread, tag, receive_from, got)
                if not to_send and len(got) == len(receive_from):
                    break
                if time.monotonic() > deadline:
                    missing = sorted(set(to_send) | (set(receive_from) - set(got)))
                    self._fail_timeout(missing, bool(to_send))
                select.select([self._listener] + [conn for conn, _ in unread], [], [], _POLL_S)
        except BaseException:
            for received in got.values():
                os.close(received)
            raise
        finally:
            for conn, _ in unread:
                conn.close()
        return got

    def _try_send(self, peer: int, fd: int, tag: int, deadline: float) -> bool:
        """Connect to ``peer`` without blocking and send; False where it cannot take it yet.

        It cannot while it is not listening yet, or while its backlog is full.
        """
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            conn.setblocking(False)
            try:
                conn.connect(self._address(peer))
            except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
                return False
            pid, uid = _credentials(conn)
            if uid != os.getuid() or self._pids[peer] not in (None, pid):
                self._fail(
                    f"rank {self.rank} found process {pid} of uid {uid} listening under rank {peer}'s name, not rank "
                    f"{peer} (pid {self._pids[peer]}, uid {os.getuid()}); no descriptor was sent to it"
                )
            conn.settimeout(max(deadline - time.monotonic(), _POLL_S))
            try:
                socket.send_fds(conn, [_HEADER.pack(self.rank, tag)], [fd])
            except (BrokenPipeError, ConnectionResetError):
                # The peer closed its listener with this connection in its backlog: it stopped,
                # and says why in the store (or it died, and the deadline names it).
                self._raise_agreed()
                return False
            return True
        finally:
            conn.close()

    def _accept(
        self, receive_from: list[int], got: dict[int, int], unread: list[tuple[socket.socket, int | None]]
    ) -> None:
        """Accept every connection waiting; keep those that may be a sender's (module docstring)."""
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            pid, uid = _credentials(conn)
            sender = next((r for r in receive_from if r not in got and self._pids[r] == pid), None)
            unknown = [r for r in receive_from if r not in got and self._pids[r] is None]
            if uid != os.getuid() or (sender is None and not unknown):
                conn.close()  # not a peer: dropped unread
                continue
            conn.setblocking(False)
            unread.append((conn, sender))
            if sum(1 for _, s in unread if s is None) > _MAX_UNREAD_PER_PEER * max(1, len(unknown)):
                oldest = next(i for i, (_, s) in enumerate(unread) if s is None)
                unread.pop(oldest)[0].close()

    def _read(
        self, unread: list[tuple[socket.socket, int | None]], tag: int, receive_from: list[int], got: dict[int, int]
    ) -> None:
        """Take the descriptor of every accepted connection whose message came; drop those that sent else."""
        keep = []
        for conn, known in unread:
            try:
                data, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 1)
            except BlockingIOError:
                keep.append((conn, known))
                continue
            except OSError:
                conn.close()
                continue
            conn.close()
            sender, their_tag = _HEADER.unpack(data) if len(data) == _HEADER.size else (-1, -1)
            expected = (
                sender in receive_from
                and sender not in got
                and (known is None and self._pids[sender] is None or known == sender)
            )
            if len(fds) != 1 or their_tag != tag or not expected:
                for received in fds:
                    os.close(received)
                continue
            got[sender] = fds[0]
        unread[:] = keep

    # Agreeing on a failure: the first rank to give up sets one key; every rank polls it.

    def _fail(self, why: str, missing: list[int] | None = None) -> None:
        mine = json.dumps({"rank": self.rank, "why": why, "missing": missing, "timeout": self.timeout})
        first = json.loads(self._store.compare_set(self._failed_key, "", mine).decode())
        self._raise(first)

    def _fail_timeout(self, missing: list[int], sending: bool) -> None:
        what = (
            "it could not hand them its file descriptor (not listening, or a full backlog)"
            if sending
            else "no file descriptor came from them"
        )
        self._fail(f"{what} over the node's Unix sockets; every rank of the node stops", missing)

    def _raise_agreed(self) -> None:
        if self._store.check([self._failed_key]):
            self._raise(json.loads(self._store.get(self._failed_key).decode()))

    def _raise(self, failure: dict) -> None:
        if failure["missing"] is not None:  # the rank that waited, named as such on every rank
            raise CommTimeoutError(
                _OP, None, failure["rank"], failure["missing"], failure["timeout"], detail=failure["why"]
            )
        raise FdExchangeRefused(f"gpucomm descriptor exchange: {failure['why']}; every rank of the node stops")
