"""Naming the culprit when a gloo call fails: which ranks are dead or never arrived.

Gloo reports a dead peer as a closed connection or a timeout, without saying which rank it was.
At init every rank publishes its host, its pid and where that pid means it (the boot and the
pid namespace: containers on one machine may share a host name but not their pids). After a
failure, each rank first checks in under the failed call's sequence number, then, for a short
grace period, watches for:

- a peer on this host whose process is gone and that did not fail a call of its own first: it
  was killed (or crashed, or left): it is the one named, at once;
- peers that check in: alive, and failing the same call.

A rank that exits after its own failure is never named for it: it failed a call first (the
node's flight record says so, in memory that outlives the process), and it checked in before
it could exit. Without that check, a survivor slower than the others would name every rank
that had already failed and exited (rank 0 among them, whose exit also takes the store with it)
instead of the rank that was killed. Peers that neither died nor checked in within the grace are named
as missing.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence

import torch.distributed as dist

from gpucomm.transport.processes import alive, pid_space

__all__ = ["Liveness"]

# A surviving rank on another host reaches the same failure within gloo's timeout; this much
# longer it is given to check in before it is named as missing.
GRACE_S = 3.0
# How often the grace period looks at the peers' pids and check-ins: a kill is seen within this.
_POLL_S = 0.02
_STORE_ERRORS = (RuntimeError, dist.DistStoreError)


class Liveness:
    def __init__(self, store: dist.Store, prefix: str, rank: int, world_size: int) -> None:
        self.store = store
        self.prefix = prefix + "live/"
        self.rank = rank
        self.world_size = world_size
        self.host = socket.gethostname()
        self.pid_space = pid_space()
        store.set(f"{self.prefix}proc/{rank}", f"{self.host} {os.getpid()} {self.pid_space}")
        self._known: list[tuple[str, str, str]] | None = None
        # Whether a rank's newest call ended in a failure of its own (the node's flight record,
        # by communicator rank), once the communicator has one (judge_by): :meth:`lost`.
        self._failed_first: Callable[[int], bool] | None = None

    def keys(self) -> list[str]:
        """Every rank's key of its process (written at init): a rank's arrival."""
        return [f"{self.prefix}proc/{r}" for r in range(self.world_size)]

    def one_host(self) -> bool:
        """Whether every rank published this host's name (waits for all of them: collective)."""
        return all(host == self.host for host, _, _ in self._procs())

    def hosts(self) -> list[str]:
        """Every rank's host name, in rank order (waits for all of them: collective)."""
        return [host for host, _, _ in self._procs()]

    def _procs(self) -> list[tuple[str, str, str]]:
        """Every rank's (host, pid, pid space), read from the store once.

        After a failure the store may be gone with rank 0, which serves it, while the pids still tell who
        died.
        """
        if self._known is None:
            keys = self.keys()
            self.store.wait(keys)
            known = []
            for key in keys:
                host, _, rest = self.store.get(key).decode().partition(" ")
                pid, _, space = rest.partition(" ")
                known.append((host, pid, space))
            self._known = known
        return self._known

    def culprits(
        self, seq: int, grace: float = GRACE_S, failed_first: Callable[[int], bool] | None = None
    ) -> list[int]:
        """The ranks to name for the failure of call ``seq`` (module docstring).

        ``failed_first(rank)`` says whether that rank's newest call ended in a failure of its own
        (the node's flight record); without it, a rank whose process is gone counts as killed.
        """
        others = [r for r in range(self.world_size) if r != self.rank]
        key = f"{self.prefix}seq{seq}/"
        store_alive = self._store_call(lambda: self.store.set(key + str(self.rank), b"1"))
        checked_in: set[int] = set()
        left_after_failing: set[int] = set()
        deadline = time.monotonic() + grace
        while True:
            gone = [r for r in others if r not in checked_in and r not in left_after_failing and self._is_dead(r)]
            killed = [r for r in gone if failed_first is None or not failed_first(r)]
            if killed:
                return killed  # gone without failing first: the first death, which the others follow
            left_after_failing.update(gone)
            if store_alive:
                waiting = [r for r in others if r not in checked_in]
                store_alive = self._store_call(
                    lambda waiting=waiting: checked_in.update(r for r in waiting if self.store.check([key + str(r)]))
                )
            if checked_in | left_after_failing >= set(others) or time.monotonic() >= deadline:
                break
            time.sleep(_POLL_S)
        missing = [r for r in others if r not in checked_in and r not in left_after_failing]
        if not store_alive and 0 in missing:
            # The store went with rank 0, which serves it, before rank 0 checked in: it left first.
            return [0]
        return missing  # empty: every peer is alive and failing too, or left after failing

    def gone(self, rank: int) -> bool:
        """Whether ``rank``'s process is known to be gone (on this host, in this pid space)."""
        return self._is_dead(rank)

    def judge_by(self, failed_last: Callable[[int], bool], global_ranks: Sequence[int]) -> None:
        """Let :meth:`lost` read the node's flight record: ``failed_last(global rank)``
        (:meth:`gpucomm.reliability.flight.FlightRecord.failed_last`)."""
        self._failed_first = lambda rank: failed_last(global_ranks[rank])

    def lost(self, rank: int) -> bool:
        """Whether ``rank``'s process is gone without having failed a call first: it crashed,
        was killed or left (a survivor that raised and exited failed its call first)."""
        return self._is_dead(rank) and not (self._failed_first is not None and self._failed_first(rank))

    def _store_call(self, call: Callable[[], object]) -> bool:
        """Run ``call`` against the store; False when the store is gone (rank 0, its server, left)."""
        try:
            call()
        except _STORE_ERRORS:
            return False
        return True

    def _is_dead(self, rank: int) -> bool:
        if self._known is None and not self._store_call(self._procs):
            return False  # the pids were never read, and the store is gone: nothing to go on
        host, pid, space = self._procs()[rank]
        if host != self.host or space != self.pid_space or not pid.isdigit():
            return False  # its pid means nothing here
        return not alive(int(pid))
