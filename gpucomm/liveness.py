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

__all__ = ["Liveness"]

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

    def one_host(self) -> bool:
        """Whether every rank published this host's name (waits for all of them: collective)."""
        keys = [f"{self.prefix}proc/{r}" for r in range(self.world_size)]
        self.store.wait(keys)
        return all(self.store.get(key).decode().partition(" ")[0] == self.host for key in keys)

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
        host, _, pid = self.store.get(f"{self.prefix}proc/{rank}").decode().partition(" ")
        if host != self.host or not pid.isdigit():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
