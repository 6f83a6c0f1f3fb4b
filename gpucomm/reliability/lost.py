"""A peer that crashed, told apart from a slow one while a workspace wait is still waiting.

A wait on a peer's flag cannot tell the two apart by the flag: it does not come either way. The
peer's process can: a peer on this host whose process is gone (its pid published at init,
:meth:`gpucomm.reliability.liveness.Liveness.lost`: gone without failing a call of its own first, as a
survivor that said the loss and exited has) will never set it, so the wait raises
:class:`~gpucomm.errors.PeerLostError` naming it, within about a second of the death, instead of
:class:`~gpucomm.errors.CommTimeoutError` at the timeout. The waits that ask: the host
executor's flag polls (gpucomm.workspace.host_executor), a blocking wait on a GPU collective's
end event and a wait on a collective the progress thread runs (gpucomm.work, gpucomm.progress),
and the watchdog's look at an asynchronous collective (gpucomm.reliability.watchdog). A kernel
blocked on a dead peer's flag is not interrupted: its own deadline ends it, with its error
record and poison as before; the host has said what happened by then.

A peer on another host has no pid that means anything here: its loss stays a timeout.

The fast path pays nothing: a wait asks only once it has lasted :data:`FIRST_LOOK_S`, then every
:data:`LOOK_EVERY_S`. One look costs about 7 us per peer on this host (a signal 0 and a read of
/proc/<pid>/stat, measured on the 2-core CI VM), so a wait of 7 peers spends under 0.02% of a core
looking.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from gpucomm.errors import PeerLostError
from gpucomm.roles import PeerLiveness

__all__ = ["LostPeers", "Looks", "FIRST_LOOK_S", "LOOK_EVERY_S"]

# A wait that lasted this long is not the fast path: a whole 2-rank all_reduce of 16 MiB on the shm
# workspace took 10 ms (median of 10; 12 ms the slowest) on the 2-core CI VM at a load average of 1.6,
# and a rank descheduled for a few of the scheduler's time slices (milliseconds each) arrives well
# within it; it is short beside the few seconds within which a death must be told.
FIRST_LOOK_S = 0.5
# Then this often: a death is told at most this long after the first look would have seen it, at
# about 30 us a second for 7 peers (module docstring).
LOOK_EVERY_S = 0.25


class Looks:
    """When one wait looks at its peers' processes: first :data:`FIRST_LOOK_S` into it, then
    every :data:`LOOK_EVERY_S`. ``due(waited_s)`` is one comparison until then. ``suspect``: the
    last look found a peer gone (:meth:`LostPeers.waiter` raises on the second such look)."""

    __slots__ = ("next", "suspect")

    def __init__(self) -> None:
        self.next = FIRST_LOOK_S
        self.suspect = False

    def due(self, waited_s: float) -> bool:
        if waited_s < self.next:
            return False
        self.next = waited_s + LOOK_EVERY_S
        return True


class LostPeers:
    """The members of one workspace (a node's ranks of a communicator) whose processes are gone.

    Args:
        liveness: the communicator's liveness registry.
        members: the communicator rank of each local rank of the workspace.
        rank: this rank in the communicator, for the error.
        timeout: the communicator's timeout (seconds), for the error.
    """

    def __init__(self, liveness: PeerLiveness, members: Sequence[int], rank: int, timeout: float) -> None:
        # Every rank's pid read now, while the store is up: after a death the store may be gone
        # with rank 0, which serves it, and the pids are all there is to go on.
        liveness.hosts()
        self.liveness = liveness
        self.members = list(members)
        self.rank = rank
        self.timeout = timeout

    def among(self, peers: Sequence[int]) -> list[int]:
        """The communicator ranks of ``peers`` (local ranks) whose processes are gone."""
        return [self.members[p] for p in peers if self.liveness.lost(self.members[p])]

    def check(self, op: str, epoch: int | None, peers: Sequence[int], started: float, where: str) -> None:
        """Raise :class:`PeerLostError` if one of ``peers`` (local ranks) is gone.

        ``started``: ``time.monotonic()`` when the wait began; ``where``: what waited, for the message
        (the call's own start is the route's: gpucomm.comm.route counts ``elapsed`` from there).
        """
        lost = self.among(peers)
        if lost:
            elapsed = time.monotonic() - started
            raise PeerLostError(op, epoch, self.rank, lost, self.timeout, elapsed, crashed=True, detail=where)

    def waiter(self, op: str, where: str, started: float | None = None) -> Callable[[], None]:
        """The look of one wait that does not know which flags its kernel waits on (a GPU
        collective's end event, a collective the progress thread runs): call it at each poll of
        the wait; from :data:`FIRST_LOOK_S` into the wait on, it raises :class:`PeerLostError`
        when another member is gone at two looks in a row.

        Why two: a peer that finished its last collective may exit at once, while this rank's
        kernel has not read its last flags yet. It finished only after this rank signalled in
        that collective, so the kernel is running and has only flags that are there to read: the
        second look, :data:`LOOK_EVERY_S` later, gives it that time.

        ``started``: when the wait began (``time.monotonic()``; default: now).
        """
        started = time.monotonic() if started is None else started
        looks = Looks()
        others = [p for p, r in enumerate(self.members) if r != self.rank]

        def look() -> None:
            if not looks.due(time.monotonic() - started):
                return
            lost = bool(self.among(others))
            if lost and looks.suspect:
                self.check(op, None, others, started, where)
            looks.suspect = lost

        return look
