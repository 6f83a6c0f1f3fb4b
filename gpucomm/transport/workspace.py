"""The symmetric workspace: one buffer per rank, every peer's buffer mapped into every rank.

Each rank's buffer is a flag area (``flag_count`` int64 epoch counters, padded to 4096 bytes)
followed by a data area (``data_bytes``, 256-byte aligned). A transport (``shm``, ``cuda_ipc``)
allocates the local buffer and maps the peers' buffers; :class:`Workspace` only hands out
:class:`~gpucomm.ops.contract.Region` views of them, so kernels never know which transport is
underneath.

The handshake runs over a ``torch.distributed.Store``, every key under ``prefix``: each rank sets
``{prefix}ws/{rank}`` to its handle, waits for every peer's handle, opens them, sets
``{prefix}ws_opened/{rank}`` and waits for everyone's (``cuda_ipc`` adds a ``ws_closed`` barrier
at close). The prefix must be unique per open (per group and generation): a reused prefix would
read the handles of an earlier open.

**Every rank takes the same decision.** A rank that cannot make its buffer (a full /dev/shm, no
device memory) publishes why in place of its handle; one that cannot open a peer's (no shared
/dev/shm, no shared IPC namespace, a malformed handle) publishes why in place of its "opened".
Then it raises at once, and every peer, which reads the same keys, raises at the same step
(:class:`~gpucomm.errors.WorkspaceUnavailableError` where every reason is the host's,
:class:`~gpucomm.errors.CommMismatchError` or :class:`~gpucomm.errors.GpucommError` otherwise)
instead of waiting out the timeout. No rank uses the workspace before every rank said "opened".
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

import torch

from gpucomm.errors import CommMismatchError, CommTimeoutError, GpucommError, WorkspaceUnavailableError
from gpucomm.ops.contract import Region

__all__ = ["Workspace", "Handshake", "FLAG_AREA_ALIGN", "DATA_ALIGN", "buffer_layout"]

# The flag area fills whole pages so that the data area starts page-aligned (and 256-B aligned
# for vectorised kernels) whatever the flag count.
FLAG_AREA_ALIGN = 4096
DATA_ALIGN = 256
FLAG_BYTES = 8  # one int64 epoch counter
# How often the close barrier looks again at the ranks it waits for, and whether they have ended:
# a close with a dead peer returns within this of the barrier's last live arrival.
_CLOSE_POLL_S = 0.02


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def buffer_layout(data_bytes: int, flag_count: int) -> tuple[int, int]:
    """``(data_offset, total_bytes)`` of one rank's buffer."""
    data_offset = _round_up(flag_count * FLAG_BYTES, FLAG_AREA_ALIGN)
    return data_offset, data_offset + _round_up(data_bytes, DATA_ALIGN)


class Workspace:
    """Every rank's buffer, addressable from this process.

    ``bases[p]`` is the address of rank p's buffer in this process and ``views[p]`` a uint8
    tensor over the same bytes (on ``device``). ``release`` frees the transport's mappings and
    memory; :meth:`close` calls it once. Regions handed out must not be used after ``close``.
    """

    def __init__(
        self,
        kind: str,
        rank: int,
        world_size: int,
        device: torch.device,
        data_bytes: int,
        flag_count: int,
        bases: Sequence[int],
        views: Sequence[torch.Tensor],
        release: Callable[[], None],
    ) -> None:
        self.kind = kind
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.data_bytes = data_bytes
        self.flag_count = flag_count
        self._data_offset, self._total_bytes = buffer_layout(data_bytes, flag_count)
        self._bases = list(bases)
        self._views = list(views)
        self._release: Callable[[], None] | None = release

    @property
    def closed(self) -> bool:
        return self._release is None

    def _peer(self, fn: str, peer: int) -> None:
        if self._release is None:
            raise GpucommError(f"Workspace.{fn}: the {self.kind} workspace is closed")
        if isinstance(peer, bool) or not isinstance(peer, int):
            raise TypeError(f"Workspace.{fn}: peer must be an int, got {type(peer).__name__}")
        if not 0 <= peer < self.world_size:
            raise ValueError(f"Workspace.{fn}: peer must be in [0, {self.world_size}), got {peer}")

    def _region(self, peer: int, offset: int, nbytes: int) -> Region:
        return Region(self._bases[peer] + offset, nbytes, self._views[peer][offset : offset + nbytes])

    def data(self, peer: int, offset: int = 0, nbytes: int | None = None) -> Region:
        """``nbytes`` bytes (default: to the end) of ``peer``'s data area from ``offset``."""
        self._peer("data", peer)
        if nbytes is None:
            nbytes = self.data_bytes - offset
        _check_range("Workspace.data", "offset", offset, "nbytes", nbytes, self.data_bytes, "bytes")
        return self._region(peer, self._data_offset + offset, nbytes)

    def flags(self, peer: int, start: int = 0, count: int | None = None) -> Region:
        """``count`` int64 flags (default: to the end) of ``peer``'s flag area from ``start``."""
        self._peer("flags", peer)
        if count is None:
            count = self.flag_count - start
        _check_range("Workspace.flags", "start", start, "count", count, self.flag_count, "flags")
        return self._region(peer, start * FLAG_BYTES, count * FLAG_BYTES)

    def flag(self, peer: int, index: int) -> Region:
        """Flag ``index`` (8 bytes) of ``peer``."""
        self._peer("flag", peer)
        _check_range("Workspace.flag", "index", index, "count", 1, self.flag_count, "flags")
        return self._region(peer, index * FLAG_BYTES, FLAG_BYTES)

    def close(self) -> None:
        """Drop every view, then unmap the peers and free this rank's buffer. Idempotent.

        For ``cuda_ipc`` this is collective (all ranks must call it): a rank frees its buffer only
        after every peer has unmapped it, or after ``timeout`` with a warning.
        """
        release, self._release = self._release, None
        if release is None:
            return
        self._views = []
        self._bases = []
        release()

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"Workspace(kind={self.kind!r}, rank={self.rank}, world_size={self.world_size}, "
            f"device={self.device}, data_bytes={self.data_bytes}, flag_count={self.flag_count}, {state})"
        )


def _check_range(fn: str, start_name: str, start: int, count_name: str, count: int, limit: int, unit: str) -> None:
    for name, value in ((start_name, start), (count_name, count)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}")
    if start < 0 or count < 0 or start + count > limit:
        raise ValueError(
            f"{fn}: [{start_name}, {start_name} + {count_name}) = [{start}, {start + count}) is outside "
            f"the {limit} {unit} of a rank's area"
        )


# First byte of a failure published in place of a handle or an "opened": no handle starts with
# it (both transports' handles start with a JSON object).
_FAILED = b"\0"


class Handshake:
    """The store protocol of one workspace open: publish, gather, barrier under one deadline.

    ``transport`` names the workspace in the errors every rank raises together (module docstring).
    """

    def __init__(
        self,
        store: torch.distributed.Store,
        prefix: str,
        rank: int,
        world_size: int,
        timeout: float,
        transport: str = "shm",
    ):
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.transport = transport
        self.deadline = time.monotonic() + timeout

    def _wait(self, op: str, stage: str, deadline: float) -> None:
        keys = [f"{self.prefix}{stage}/{r}" for r in range(self.world_size)]
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            self.store.wait(keys, datetime.timedelta(seconds=remaining))
        except RuntimeError as exc:  # torch raises DistStoreError or a plain RuntimeError on expiry
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            if not missing:
                raise
            raise CommTimeoutError(
                op=op,
                epoch=None,
                rank=self.rank,
                missing=missing,
                timeout=self.timeout,
                detail=f"no '{stage}' key from them under prefix {self.prefix!r}",
            ) from exc

    def _gather(self, stage: str) -> list[bytes]:
        """Every rank's value at ``stage`` once all are there; the agreed error if any failed."""
        self._wait("workspace open", stage, self.deadline)
        values = [self.store.get(f"{self.prefix}{stage}/{r}") for r in range(self.world_size)]
        failures = {r: _failure(value) for r, value in enumerate(values) if value[:1] == _FAILED}
        if failures:
            self._all_read(stage)
            raise self._agreed(failures)
        return values

    def _all_read(self, stage: str) -> None:
        """After a failed step, rank 0 waits until every rank has read it.

        In an env:// job rank 0 serves the store, and its process ending (the likely next step after an
        error) would cut the others' reads short, leaving them a connection error instead of the agreed
        one.
        """
        self.store.set(f"{self.prefix}{stage}_read/{self.rank}", b"1")
        if self.rank == 0:
            try:
                self._wait("workspace open", f"{stage}_read", self.deadline)
            except CommTimeoutError:
                pass  # a peer that died after its word: the error is raised all the same

    def _agreed(self, failures: dict[int, dict[str, str]]) -> GpucommError:
        """The error every rank raises for ``failures`` (rank -> what it published)."""
        if all(f["kind"] == "unavailable" for f in failures.values()):
            advice = " ".join(dict.fromkeys(f["advice"] for f in failures.values() if f["advice"]))
            return WorkspaceUnavailableError(self.transport, {r: f["reason"] for r, f in failures.items()}, advice)
        said = "; ".join(f"rank {r}: {f['reason']}" for r, f in sorted(failures.items()))
        message = f"gpucomm {self.transport} workspace: rank {self.rank} cannot open it because peers could not: {said}"
        if any(f["kind"] == "mismatch" for f in failures.values()):
            return CommMismatchError(message, op="workspace open", rank=self.rank, peers=sorted(failures))
        return GpucommError(message)

    def agree(self, values: Mapping[str, int | str]) -> None:
        """Check that every rank passed the same ``values`` (what the ranks lay the workspace out
        by, each computed locally: the channels of the flag layout); a difference is a
        :class:`~gpucomm.errors.CommMismatchError` on every rank, naming each rank's value.

        The buffers' sizes do not show such a difference: the flag area is padded to whole pages.
        """
        self.store.set(f"{self.prefix}agree/{self.rank}", json.dumps(dict(values), sort_keys=True).encode())
        self._wait("workspace open", "agree", self.deadline)
        seen = [json.loads(self.store.get(f"{self.prefix}agree/{r}")) for r in range(self.world_size)]
        differ = sorted(name for name in values if len({json.dumps(s.get(name)) for s in seen}) > 1)
        if not differ:
            return
        said = "; ".join(
            f"{name}: " + ", ".join(f"rank {r} has {s.get(name)}" for r, s in enumerate(seen)) for name in differ
        )
        raise CommMismatchError(
            f"gpucomm {self.transport} workspace: the ranks disagree on what lays the workspace out ({said}); "
            f"every rank must compute the same (set GPUCOMM_CHANNELS alike on every rank, or leave it unset)",
            op="workspace open",
            rank=self.rank,
            peers=[r for r, s in enumerate(seen) if any(s.get(name) != values[name] for name in differ)],
        )

    def exchange(self, handle: bytes) -> list[bytes]:
        """Publish this rank's handle; return every rank's (own included) once all are there.

        Raises the agreed error (module docstring) if a peer published a failure instead."""
        self.store.set(f"{self.prefix}ws/{self.rank}", handle)
        return self._gather("ws")

    def opened(self) -> None:
        """Barrier: return once every rank has opened every peer (else the agreed error)."""
        self.store.set(f"{self.prefix}ws_opened/{self.rank}", b"1")
        self._gather("ws_opened")

    def fail(self, error: GpucommError) -> NoReturn:
        """Publish that this rank cannot go on, wait for every peer's word, and raise the agreed error.

        The word goes in place of this rank's handle where it has not published one yet, else of its
        "opened". Waiting for every peer's word at that step means none is still opening this rank's
        buffer when it goes. What it raises is what every rank raises there: the agreed error, or
        ``error`` itself where it is of the agreed kind (module docstring).
        """
        own = _kind(error)
        if own == "unavailable":
            reason, advice = error.reasons.get(self.rank, str(error)), error.advice  # type: ignore[attr-defined]
        else:
            reason, advice = (str(error).splitlines() or [type(error).__name__])[0], ""
        value = json.dumps({"kind": own, "reason": reason, "advice": advice})
        try:
            stage = "ws_opened" if self.store.check([f"{self.prefix}ws/{self.rank}"]) else "ws"
            self.store.set(f"{self.prefix}{stage}/{self.rank}", _FAILED + value.encode("utf-8"))
        except RuntimeError as gone:  # the store went with rank 0: no one is left to agree with
            raise error from gone
        agreed: GpucommError | None = None
        try:
            self._gather(stage)
        except CommTimeoutError:
            raise
        except GpucommError as exc:
            agreed = exc
        if agreed is None or (own != "unavailable" and _kind(agreed) == own):
            raise error  # its own words say more than the agreed ones; it is of their kind
        raise agreed from error

    def closed(self, gone: Callable[[int], bool] | None = None) -> None:
        """Barrier with a fresh ``timeout``: return once every rank has unmapped its peers or has ended.

        A rank known to be gone (``gone(rank)``: its mappings went with its process) is never waited for.
        """
        self.store.set(f"{self.prefix}ws_closed/{self.rank}", b"1")
        deadline = time.monotonic() + self.timeout
        if gone is None:
            self._wait("workspace close", "ws_closed", deadline)
            return
        waiting = [r for r in range(self.world_size) if r != self.rank]
        while True:
            waiting = [r for r in waiting if not self.store.check([f"{self.prefix}ws_closed/{r}"]) and not gone(r)]
            if not waiting:
                return
            if time.monotonic() >= deadline:
                raise CommTimeoutError(
                    op="workspace close",
                    epoch=None,
                    rank=self.rank,
                    missing=waiting,
                    timeout=self.timeout,
                    detail=f"no 'ws_closed' key from them under prefix {self.prefix!r}",
                )
            time.sleep(_CLOSE_POLL_S)


def _kind(error: GpucommError) -> str:
    """What a failure means for the others: the host's (they may fall back), a mismatch, or other."""
    if isinstance(error, WorkspaceUnavailableError):
        return "unavailable"
    return "mismatch" if isinstance(error, CommMismatchError) else "error"


def _failure(value: bytes) -> dict[str, str]:
    """What a peer published with :meth:`Handshake.fail` (kind, reason, advice)."""
    try:
        said = json.loads(value[1:].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        said = None
    if not isinstance(said, dict) or not all(isinstance(said.get(k), str) for k in ("kind", "reason", "advice")):
        return {"kind": "error", "reason": f"published a malformed failure {value[:80]!r}", "advice": ""}
    return {k: said[k] for k in ("kind", "reason", "advice")}
