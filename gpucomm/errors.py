"""The exceptions gpucomm raises.

Bad arguments raise the builtin ``ValueError`` / ``TypeError``; everything that goes wrong with
the environment, a peer or a timeout raises a subclass of :class:`GpucommError`.

A failed or timed-out collective (:class:`CommTimeoutError`, :class:`CommMismatchError`,
:class:`CommBrokenError`) is also a ``torch.distributed.DistBackendError``, the type torch raises
for its own backends' failures, so that code written for torch.distributed (torchelastic,
fault-tolerant trainers) catches gpucomm's too. Every GpucommError is a
``torch.distributed.DistError`` (torch's base of its distributed errors), and
:class:`NotInitializedError` a ``ValueError`` too, which is what torch raises for a call before
``init_process_group`` ("Default process group has not been initialized"). torch's gloo raises
a bare RuntimeError on a timeout and NCCL's watchdog a DistBackendError: gpucomm's timeout is
both (DistBackendError is a RuntimeError).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from torch.distributed import DistBackendError, DistError, DistStoreError

__all__ = [
    "GpucommError",
    "NotInitializedError",
    "UnsupportedError",
    "WorkspaceUnavailableError",
    "CommTimeoutError",
    "NeverJoinedError",
    "PeerLostError",
    "CommMismatchError",
    "KnobMismatchError",
    "CommBrokenError",
    "KernelCompileError",
    "StoreInconsistentError",
]


class GpucommError(DistError):
    """Base class of gpucomm's own runtime errors."""


class NotInitializedError(GpucommError, ValueError):
    """A collective was called before ``init_process_group`` (or after destroy)."""


class UnsupportedError(GpucommError):
    """A knob asked for something this host cannot do (e.g. ``GPUCOMM_KERNELS=cuda`` without CUDA)."""


class WorkspaceUnavailableError(UnsupportedError):
    """The symmetric workspace cannot be made for these ranks on this host.

    For example: a /dev/shm too small for it, ranks that cannot open each other's segments (no
    shared /dev/shm), CUDA IPC handles that cannot be opened (no shared IPC namespace, no peer
    access).

    Every rank of the open raises it at the same step (they agree through the store), before any
    rank uses the workspace. ``transport`` names the workspace ("shm", "cuda_ipc"), ``reasons``
    maps each rank that could not go on to why; ``advice`` says what would fix it. With
    ``GPUCOMM_TRANSPORT=auto`` the communicator serves those tensors through gloo instead.
    """

    def __init__(self, transport: str, reasons: Mapping[int, str], advice: str = "") -> None:
        self.transport = transport
        self.reasons = dict(sorted(reasons.items()))
        self.advice = advice
        said = "; ".join(f"rank {rank}: {why}" for rank, why in self.reasons.items())
        super().__init__(f"gpucomm {transport} workspace unavailable: {said}" + (f". {advice}" if advice else ""))


class _Story:
    """An error that can carry the story of the hang: what every rank involved was doing.

    gpucomm.reliability.story builds it from the node's flight records.
    """

    story: str = ""

    def tell(self, story: str) -> None:
        """Append ``story`` to the message, once (the first teller knows the most: the raise)."""
        if story and not self.story:
            self.story = story
            self.args = (f"{self.args[0]}\n{story}" if self.args else story,)


class CommTimeoutError(_Story, GpucommError, DistBackendError):
    """A peer did not arrive before the deadline.

    Attributes name what the error message says: the collective, the epoch (the communicator's
    step counter, equal on all ranks for the same step), the waiting rank and the ranks that were
    still missing when the deadline passed. Where the raiser says which group it waited in
    (``global_ranks``, the global rank of each group rank), the message names the group and both
    numberings, and ``missing_global`` holds the missing ranks' global numbers.
    """

    def __init__(
        self,
        op: str,
        epoch: int | None,
        rank: int,
        missing: Sequence[int],
        timeout: float,
        detail: str = "",
        *,
        global_ranks: Sequence[int] | None = None,
        world: bool = False,
    ) -> None:
        self.op = op
        self.epoch = epoch
        self.rank = rank
        self.missing = list(missing)
        self.timeout = timeout
        # global_ranks[r]: the global rank of group rank r (None: not said; rank and missing are
        # then as the caller numbered them); world: the group is the world (one numbering).
        self.global_ranks = None if global_ranks is None else list(global_ranks)
        self.missing_global = self.missing if global_ranks is None else [self.global_ranks[r] for r in self.missing]
        where = f" epoch {epoch}" if epoch is not None else ""
        extra = f": {detail}" if detail else ""
        who, whom = f"rank {rank}", f"rank(s) {self.missing}"
        if self.global_ranks is not None:
            if world:
                where += f" on the world of {len(self.global_ranks)} ranks"
            else:
                where += f" on the group of global ranks {self.global_ranks}"
                who = f"group rank {rank} (global {self.global_ranks[rank]})"
                whom = f"group rank(s) {self.missing} (global {self.missing_global})"
        super().__init__(f"gpucomm {op}{where}: {who} timed out after {timeout:g} s waiting for {whom}{extra}")


class NeverJoinedError(CommTimeoutError):
    """An init's deadline passed before some ranks arrived at all: "rank 2 never joined (2 of 3
    arrived after 300 s)", raised on every rank that waited. ``missing`` (group ranks) and
    ``missing_global`` name the absent ranks, ``arrived`` counts the others (None where rank 0,
    which serves the store, never came: ``store_at`` names where it was looked for)."""

    def __init__(
        self,
        op: str,
        rank: int,
        missing: Sequence[int],
        world_size: int,
        timeout: float,
        *,
        global_ranks: Sequence[int] | None = None,
        world: bool = True,
        store_at: str = "",
    ) -> None:
        super().__init__(op, None, rank, missing, timeout, global_ranks=global_ranks, world=world)
        self.arrived = world_size - len(self.missing)
        counted = f"({self.arrived} of {world_size} arrived after {timeout:g} s)"
        if store_at:  # rank 0 serves the store: without it no rank can even count the others
            self.arrived = None  # type: ignore[assignment]
            said = (
                f"gpucomm.{op}: rank 0 never joined (no store at {store_at}, which rank 0 serves, after {timeout:g} "
                "s); start rank 0, or check MASTER_ADDR and MASTER_PORT (or the tcp:// address)"
            )
        elif world or self.global_ranks is None:
            who = ("rank " if len(self.missing) == 1 else "ranks ") + ", ".join(str(r) for r in self.missing_global)
            said = (
                f"gpucomm.{op}: {who} never joined {counted}; start every rank, or check WORLD_SIZE and each "
                "rank's RANK"
            )
        else:
            said = (
                f"gpucomm.{op} on the group of global ranks {self.global_ranks}: group rank(s) {self.missing} "
                f"(global {self.missing_global}) never joined {counted}; every member must make the group"
            )
        self.args = (said,)


class PeerLostError(CommTimeoutError):
    """A peer went away in the middle of a call, as opposed to one that is slow: its process is
    gone (``crashed``: it crashed, was killed or exited), or its connection closed. Raised as
    soon as the failure is seen, ``elapsed`` seconds into the call, not after the timeout; a
    :class:`CommTimeoutError` still, for code that catches that. gloo says a closed connection;
    on the workspace path a wait sees a peer's process gone (gpucomm.reliability.lost)."""

    def __init__(
        self, op: str, epoch: int | None, rank: int, missing: Sequence[int], timeout: float, elapsed: float,
        *, crashed: bool, detail: str = "",
    ) -> None:  # fmt: skip
        super().__init__(op, epoch, rank, missing, timeout, detail)
        self.elapsed = elapsed
        self.crashed = crashed
        self.detail = detail
        self.seen_at = time.monotonic()  # when the loss was seen (counted_from)
        where = f" call {epoch}" if epoch is not None else ""
        what = (
            "its process is gone (it crashed, was killed or exited)"
            if crashed
            else "it closed its connection (its process crashed or its host went away)"
        )
        self.args = (
            f"gpucomm {op}{where}: rank {rank} lost rank(s) {self.missing} {elapsed:.1f} s into the call: {what}; "
            f"not a slow rank, which is waited for up to the timeout ({timeout:g} s)"
            + (f" [{detail}]" if detail else ""),
        )

    def counted_from(self, started: float) -> PeerLostError:
        """This error with ``elapsed`` counted from ``started`` (``time.monotonic()`` at the call's
        start) to when the loss was seen: a wait that saw it knows only when the wait began."""
        error = PeerLostError(
            self.op, self.epoch, self.rank, self.missing, self.timeout, self.seen_at - started,
            crashed=self.crashed, detail=self.detail,
        )  # fmt: skip
        error.seen_at = self.seen_at
        return error


class CommMismatchError(_Story, GpucommError, DistBackendError):
    """Ranks called different collectives (or sizes, dtypes, ops, roots) in the same epoch.

    ``rank`` is the rank raising and ``peers`` the ranks whose calls differ from its own (empty
    where the path cannot tell which); ``op`` and ``epoch`` as in :class:`CommTimeoutError`.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        epoch: int | None = None,
        rank: int | None = None,
        peers: Sequence[int] = (),
    ) -> None:
        self.op = op
        self.epoch = epoch
        self.rank = rank
        self.peers = list(peers)
        super().__init__(message)


class KnobMismatchError(CommMismatchError):
    """At init, the ranks were given different values of a knob that must agree (transport,
    kernels, algo, workspace or heap size, timeout, check): raised on every rank, before any
    workspace or gloo group is made. ``knobs`` maps each differing knob to every rank's value,
    in rank order; the message names each rank's value (gpucomm.comm.agreement)."""

    def __init__(self, message: str, *, knobs: Mapping[str, Sequence[object]], rank: int) -> None:
        self.knobs = {name: list(values) for name, values in knobs.items()}
        differ = sorted({r for values in self.knobs.values() for r, v in enumerate(values) if v != values[rank]})
        super().__init__(message, rank=rank, peers=differ)


class CommBrokenError(GpucommError, DistBackendError):
    """The communicator failed earlier; every later call raises this with the original cause."""


class KernelCompileError(GpucommError):
    """A kernel failed to compile; the message carries the compiler's log."""


class StoreInconsistentError(GpucommError, DistStoreError):
    """The rendezvous store holds what gpucomm's ranks did not write there, or lost what they did.

    Anyone who can reach a TCPStore may read and write every key (docs/reliability.md, ## Threats):
    such writes can make an init fail with this error, which names the call and what was found,
    never a rank. Also a ``torch.distributed.DistStoreError``, the type torch raises for its
    stores' failures.
    """
