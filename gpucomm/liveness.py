"""Naming the culprit when a gloo call fails: which ranks are dead or never arrived.

Gloo reports a dead peer as a closed connection or a timeout, without saying which rank it was.
At init every rank publishes its host and pid; after a failure, ranks on this host are checked
directly (a pid that no longer exists is a dead rank, known at once), and ranks elsewhere are
asked to check in under the failed call's sequence number for a short grace period.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

__all__ = ["Liveness", "alive"]

# A surviving rank on another host reaches the same failure within gloo's timeout; this much
# longer it is given to check in before it is named as missing.
GRACE_S = 3.0


class Liveness:
    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int) -> None:
        self.store = store
        self.prefix = prefix + "live/"
        self.rank = rank
        self.world_size = world_size
        self.host = socket.gethostname()
        store.set(f"{self.prefix}proc/{rank}", f"{self.host} {os.getpid()}")
        self._known: list[tuple[str, str]] | None = None

    def one_host(self) -> bool:
        """Whether every rank published this host's name (waits for all of them: collective)."""
        return all(host == self.host for host, _ in self._procs())

    def _procs(self) -> list[tuple[str, str]]:
        """Every rank's (host, pid), read from the store once: after a failure the store may be
        gone with rank 0, which serves it, while the pids still tell who died."""
        if self._known is None:
            keys = [f"{self.prefix}proc/{r}" for r in range(self.world_size)]
            self.store.wait(keys)
            self._known = [tuple(self.store.get(key).decode().partition(" ")[::2]) for key in keys]  # type: ignore[misc]
        return self._known

    def culprits(self, seq: int, grace: float = GRACE_S) -> list[int]:
        """Ranks that are dead (same host) or did not check in for call ``seq`` within ``grace``."""
        try:
            dead = [r for r in range(self.world_size) if r != self.rank and self._is_dead(r)]
            if dead:
                return dead
            key = f"{self.prefix}seq{seq}/"
            self.store.set(key + str(self.rank), b"1")
            others = [r for r in range(self.world_size) if r != self.rank]
            try:
                self.store.wait([key + str(r) for r in others], datetime.timedelta(seconds=grace))
            except (RuntimeError, dist.DistStoreError):
                pass
            return [r for r in others if not self.store.check([key + str(r)])]
        except (RuntimeError, dist.DistStoreError):
            # The store itself is gone: rank 0 serves it, so rank 0 is the one that died.
            return [0] if self.rank != 0 else []

    def _is_dead(self, rank: int) -> bool:
        host, pid = self._procs()[rank]
        if host != self.host or not pid.isdigit():
            return False
        return not alive(int(pid))


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited. A killed process stays in the process
    table as a zombie until its parent reaps it (a launcher may take a while), and signal 0 still
    reaches it; /proc says it is dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc here: signal 0 is all there is
    return state not in (b"Z", b"X")
