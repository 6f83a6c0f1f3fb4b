"""File descriptors between the ranks of one node, over Unix sockets (SCM_RIGHTS).

The driver's virtual-memory API shares an allocation as a POSIX file descriptor; a descriptor
means something only inside its process, so it travels the way torch's symmetric memory sends
its own: as ancillary data of a Unix socket (``socket.send_fds`` / ``recv_fds``). Not
``pidfd_getfd``, which containers refuse without ptrace rights.

Each rank listens on an abstract-namespace socket (no file left behind, whatever ends the
process) named from the store prefix and its rank. :meth:`FdExchange.share` has every rank
connect to every peer and send its descriptor with its rank number (a connect completes into
the listener's backlog, so nobody waits for an accept), then accept one connection per peer and
receive theirs. A connection from another user is refused (``SO_PEERCRED``); a peer that never
connects ends in CommTimeoutError at the deadline.
"""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import time

from gpucomm.errors import CommTimeoutError, GpucommError

__all__ = ["FdExchange"]

_HEADER = struct.Struct("<ii")  # sender's rank, what the descriptor is (a tag the caller gives)
_RETRY_S = 0.01


class FdExchange:
    """The Unix sockets of one exchange between ``world_size`` ranks of a node (module docstring).

    Build it on every rank before the store barrier that says every rank listens; then call
    :meth:`share` (or :meth:`send`/:meth:`receive`) once per descriptor set; :meth:`close` at the end.
    """

    def __init__(self, prefix: str, rank: int, world_size: int, timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self._token = hashlib.sha256(f"{prefix}|{os.getuid()}".encode()).hexdigest()[:24]
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._listener.bind(self._address(rank))
        self._listener.listen(max(1, world_size))

    def _address(self, rank: int) -> bytes:
        return f"\0gpucomm-{self._token}-r{rank}".encode()

    def send(self, peers: list[int], fd: int, tag: int) -> None:
        """Send ``fd`` (with ``tag``) to every rank of ``peers``."""
        deadline = time.monotonic() + self.timeout
        for peer in peers:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                while True:
                    try:
                        conn.connect(self._address(peer))
                        break
                    except (ConnectionRefusedError, FileNotFoundError):
                        if time.monotonic() > deadline:
                            raise CommTimeoutError(
                                "symmetric heap open", None, self.rank, [peer], self.timeout,
                                detail="its Unix socket for file descriptors never listened",
                            ) from None
                        time.sleep(_RETRY_S)
                socket.send_fds(conn, [_HEADER.pack(self.rank, tag)], [fd])
            finally:
                conn.close()

    def receive(self, count: int) -> dict[tuple[int, int], int]:
        """``count`` descriptors from peers: ``{(sender, tag): fd}`` (the caller closes them)."""
        got: dict[tuple[int, int], int] = {}
        self._listener.settimeout(self.timeout)
        try:
            while len(got) < count:
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    missing = sorted(set(range(self.world_size)) - {s for s, _ in got} - {self.rank})
                    raise CommTimeoutError(
                        "symmetric heap open", None, self.rank, missing, self.timeout,
                        detail="no file descriptor came from them over the node's Unix sockets",
                    ) from None
                with conn:
                    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
                    if uid != os.getuid():
                        raise GpucommError(f"gpucomm symmetric heap: a process of uid {uid} connected to rank {self.rank}'s socket; refused")
                    data, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 1)
                    if len(data) != _HEADER.size or len(fds) != 1:
                        for fd in fds:
                            os.close(fd)
                        raise GpucommError(f"gpucomm symmetric heap: rank {self.rank} got a malformed descriptor message ({len(data)} bytes, {len(fds)} fds)")
                    sender, tag = _HEADER.unpack(data)
                    got[(sender, tag)] = fds[0]
        except BaseException:
            for fd in got.values():
                os.close(fd)
            raise
        return got

    def share(self, fd: int, tag: int = 0) -> dict[int, int]:
        """Every peer's descriptor for ``tag`` in exchange for this rank's: ``{peer: fd}``."""
        peers = [p for p in range(self.world_size) if p != self.rank]
        self.send(peers, fd, tag)
        return {sender: fd for (sender, _), fd in self.receive(len(peers)).items()}

    def close(self) -> None:
        self._listener.close()
