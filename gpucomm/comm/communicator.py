"""``Communicator``: one group of ranks and every collective on it, without global state.

This module holds its life cycle (its paths, opened and closed), its subgroups and its
symmetric memory; its collectives check their arguments in :mod:`gpucomm.comm.collectives` and
take the route of :mod:`gpucomm.comm.route` to one of its paths:

- the *workspace* path (``gpucomm.workspace.engine``): gpucomm's own kernels over the symmetric
  workspace (CUDA IPC for CUDA tensors, POSIX shared memory for CPU tensors with
  ``GPUCOMM_TRANSPORT=shm``);
- the *fallback* path (``gpucomm.gloo.fallback``): gloo, built on gpucomm's own store.

Ranks given to a Communicator's methods (src, dst, root) are ranks of this communicator.
All ranks of the group must call each collective, in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import threading
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from gpucomm import log
from gpucomm.comm.agreement import agree
from gpucomm.comm.arrivals import draw_prefix, store_wait
from gpucomm.comm.collectives import Collectives
from gpucomm.comm.graph_capture import capturing_in_place, register
from gpucomm.comm.memory import SymmetricMemory
from gpucomm.comm.point_to_point import PointToPoint
from gpucomm.comm.summary import summary_lines
from gpucomm.comm.validation import check_rank
from gpucomm.config import Config, check_timeout
from gpucomm.errors import GpucommError, UnsupportedError, WorkspaceUnavailableError
from gpucomm.gloo.fallback import GlooFallback
from gpucomm.language.context import DeviceContext
from gpucomm.ops.registry import kernels_run_on_cpu
from gpucomm.progress import Progress, exiting
from gpucomm.reliability.flight import FlightLog, FlightRecord, group_label
from gpucomm.reliability.liveness import Liveness
from gpucomm.reliability.story import NodeStatus, StatusSignal, node_status
from gpucomm.reliability.watchdog import forget as forget_watched
from gpucomm.reliability.watchdog import stop as stop_watchdog
from gpucomm.workspace.engine import Engine
from gpucomm.workspace.repeat import Repeats

__all__ = ["Communicator", "release_all"]


# How long the process's exit waits for a communicator's progress thread to stop (one that waits
# on gloo sees the exit within 0.5 ms; one inside a workspace collective ends at that one's deadline).
_EXIT_JOIN_S = 2.0
# Communicators not closed yet: their threads are stopped at exit (release_all).
_LIVE: weakref.WeakSet[Communicator] = weakref.WeakSet()


def release_all() -> None:
    """Stop every thread gpucomm started, for a process that exits (whether or not it destroyed
    its groups): the watchdog first (it asks gloo's works), then each open communicator's
    progress thread and gloo's threads (the inter-node groups' too). Nothing collective happens:
    peers may be gone already, and the process's exit frees the workspaces."""
    stop_watchdog()
    exiting()  # the progress threads' waits on gloo end now: they are joined before the interpreter goes
    for comm in list(_LIVE):
        comm._release_threads()


def _attempt(step: Callable[[], object], failures: list[BaseException]) -> None:
    """Run one step of a close, keeping its failure for after the rest (a CUDA error is a
    RuntimeError, as are gpucomm's own; a file or socket refusal an OSError)."""
    try:
        step()
    except (RuntimeError, OSError) as exc:
        failures.append(exc)


def _label(kernels: object) -> str:
    """What the log calls ``kernels``: their label where they have one ("cuda (emulated)")."""
    return getattr(kernels, "label", kernels.name)  # type: ignore[attr-defined]


def _rank_device(local_rank: int) -> torch.device | None:
    """This rank's GPU: LOCAL_RANK modulo the visible devices (several ranks may share one)."""
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", local_rank % torch.cuda.device_count())


class Communicator(Collectives, PointToPoint, SymmetricMemory):
    """A group of ``world_size`` ranks; this process is ``rank``.

    Build one with :func:`gpucomm.init_process_group` (the default group) or
    :func:`gpucomm.new_group`, or directly from a store::

        store = torch.distributed.TCPStore("127.0.0.1", 29500, 2, rank == 0)
        with gpucomm.Communicator(store, rank, 2) as comm:
            comm.all_reduce(t)
    """

    # The backend string of init_process_group that made it ("nccl", ...), for get_backend(); None: not made so.
    backend_name: str | None = None

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        *,
        prefix: str | None = None,
        config: Config | None = None,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        global_ranks: Sequence[int] | None = None,
        device: torch.device | None = None,
        flight: FlightRecord | None = None,
        fn: str = "Communicator",
    ) -> None:
        """``prefix``: where its keys live in ``store``; None draws a fresh one from the store
        (collective), so that communicators built on one store never read each other's keys.
        ``flight``: the flight record of the parent communicator (a subgroup writes its calls
        into it); None opens this communicator's own (collective). ``fn``: the public call that
        builds it, named by its errors (a timeout names the call, the group and the ranks it
        waited for, in group and global numbering)."""
        self.config = config if config is not None else Config.from_env()
        check_timeout(self.config.timeout, fn, "timeout")  # a Config built directly is unchecked
        log.enable(self.config.debug)
        self.rank = check_rank(rank, world_size, "Communicator", "rank")
        self.world_size = world_size
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(world_size))
        self.local_rank = rank if local_rank is None else local_rank
        self.local_world_size = world_size if local_world_size is None else local_world_size
        if self.config.local_world_size is not None:
            self.local_world_size = self.config.local_world_size
        self.store = store
        # How errors name this group: the world (None), or by its global ranks (the rule of
        # gpucomm.reliability.flight.group_label).
        named = None if flight is None and self.global_ranks == list(range(world_size)) else self.global_ranks
        if prefix is None:
            prefix = draw_prefix(store, self.rank, world_size, self.config.timeout, fn, named)
        self.prefix = prefix
        # device: the GPU this rank was pinned to (init_process_group(device_id=...)); by default
        # the one of its local rank.
        self.device = device if device is not None else _rank_device(self.local_rank)
        self.timeout = self.config.timeout
        self._subgroups = 0
        # Calls from several threads: one at a time, in the order they take it (Router._route).
        self._lock = threading.RLock()
        self._calls = 0  # collective calls so far: equal on all ranks for the same call
        # Blocking all_reduce calls seen before, by (address, count, dtype, op): the launch of
        # their program on their buffers, every decision taken (gpucomm.workspace.repeat).
        self._repeat = Repeats()
        self._broken: BaseException | None = None
        self._closed = False
        self._liveness = Liveness(store, prefix, rank, world_size)
        # Every rank arrived before gloo connects: a rank that never comes is named here, by the
        # call, the group and its ranks; gloo's own wait would end in a raw DistStoreError.
        everyone = list(range(world_size))
        store_wait(
            store,
            self._liveness.keys(),
            self.timeout,
            op=fn,
            rank=rank,
            waited_ranks=everyone,
            global_ranks=self.global_ranks,
            world=named is None,
        )
        # Knobs that must agree are compared before any path is made on them (gpucomm.comm.agreement).
        agree(store, prefix, self.config, rank, world_size, fn, self.global_ranks)
        self._fallback = GlooFallback(
            dist.PrefixStore(prefix + "gloo/", store), rank, world_size, self.timeout, fn, named
        )
        self._engines: dict[str, Engine] = {}  # device type -> the workspace engine serving it
        self._own_record: FlightRecord | None = None
        self._signal: StatusSignal | None = None
        self._progress = Progress(f"gpucomm-progress-r{rank}")  # async calls on the host workspace
        try:
            if flight is None:
                flight = self._own_record = FlightRecord(
                    store,
                    prefix,
                    self.global_ranks,
                    rank,
                    self.local_world_size,
                    self._liveness.one_host(),
                    self.timeout,
                )
            self._flight = FlightLog(flight, group_label(self.global_ranks, self._own_record is not None, world_size))
            self._liveness.judge_by(flight.failed_last, self.global_ranks)  # survivors exit after failing
            if self.config.status_signal and self._own_record is not None:
                self._signal = StatusSignal(
                    self._flight, self.global_ranks[rank], signal.Signals[self.config.status_signal]
                )
            fallbacks = []  # (what this host cannot give, why), for the one warning line
            for device_type, (transport, kernels) in self._workspace_plan().items():
                try:
                    engine = Engine.create(self, transport, kernels)
                except WorkspaceUnavailableError as exc:
                    fallbacks.append(self._fall_back(device_type, exc))
                    continue
                if engine is not None:
                    self._engines[device_type] = engine
            if self._own_record is not None and self._own_record.unshared:
                fallbacks.append(("the flight record keeps to each rank", self._own_record.unshared))
            self._warn_fallbacks(fallbacks)
        except BaseException:
            self._close_engines()
            self._close_record()
            self._fallback.close()
            raise
        _LIVE.add(self)
        # The start-up summary, once per job: the world's init (not a bare Communicator's, nor a subgroup's).
        world_init = fn.startswith("init_process_group") and self._own_record is not None
        if world_init and self.global_ranks[rank] == 0 and log.logger.isEnabledFor(logging.INFO):
            hosts = self._liveness.hosts()
            for line in summary_lines(
                rank, world_size, self.local_world_size, hosts, self._engines, list(self.paths()), self.config
            ):
                log.logger.info(line)

    # -- life cycle ---------------------------------------------------------------------------
    def _workspace_plan(self) -> dict[str, tuple[str, str]]:
        """Which transport and kernels serve the tensors of each device type (the rest: gloo).

        ``auto``: CUDA tensors on the CUDA IPC workspace, CPU tensors on the shared-memory one when
        every rank runs on this host. A transport named explicitly serves its own device type and
        must work. The kernels knob applies where it can: CPU tensors run the torch kernels unless
        the Triton interpreter is on, whatever kernels a GPU uses.
        """
        config = self.config
        if config.kernels == "cuda" and self.device is None and not kernels_run_on_cpu("cuda"):
            raise UnsupportedError(
                "gpucomm: GPUCOMM_KERNELS=cuda needs a CUDA device, and this host has none (GPUCOMM_CUDA_EMULATE=1 "
                "runs the CUDA C++ kernels built for the host on CPU tensors)"
            )
        if config.transport == "gloo":
            return {}
        if config.transport == "shm":
            return {"cpu": ("shm", config.kernels)}
        if config.transport == "cuda_ipc":
            if self.device is None:
                raise UnsupportedError(
                    "gpucomm: GPUCOMM_TRANSPORT=cuda_ipc needs a CUDA device, and this host has none"
                )
            return {"cuda": ("cuda_ipc", config.kernels)}
        plan = {}
        if self.device is not None:
            plan["cuda"] = ("cuda_ipc", config.kernels)
        if self._liveness.one_host():
            plan["cpu"] = ("shm", config.kernels if kernels_run_on_cpu(config.kernels) else "auto")
        return plan

    def _fall_back(self, device_type: str, exc: WorkspaceUnavailableError) -> tuple[str, str]:
        """The workspace of ``device_type`` cannot be made here, as every rank agreed: under
        ``GPUCOMM_TRANSPORT=auto`` gloo serves those tensors (what to say of it is returned);
        a transport asked for by name raises."""
        if self.config.transport != "auto":
            raise WorkspaceUnavailableError(
                exc.transport,
                exc.reasons,
                f"{exc.advice}; or leave GPUCOMM_TRANSPORT unset (auto) to serve these tensors through gloo".lstrip(
                    "; "
                ),
            ) from exc
        said = str(exc).replace(
            "GPUCOMM_WORKSPACE_BYTES", f"GPUCOMM_WORKSPACE_BYTES (now {self.config.workspace_bytes_for(device_type)})"
        )
        return f"{device_type.upper()} tensors go through gloo", said

    def _warn_fallbacks(self, fallbacks: list[tuple[str, str]]) -> None:
        """One warning line, on every rank, for what this host could not give this communicator
        (each rank's own log says why its tensors took gloo: ranks' logs are often kept apart).
        The first reason stands for the rest: on one host they are the same one (a /dev/shm that
        is full, or not shared)."""
        if not fallbacks:
            return
        label = group_label(self.global_ranks, self._own_record is not None, self.world_size)
        what = ", and ".join(w for w, _ in fallbacks)
        log.logger.warning(f"gpucomm[rank {self.global_ranks[self.rank]}]: {label}: {what}: {fallbacks[0][1]}")

    def _close_engines(self) -> None:
        engines, self._engines = list(self._engines.values()), {}
        failures: list[BaseException] = []
        for engine in engines:  # each its own workspace: one that cannot close keeps none of the rest
            _attempt(engine.close, failures)
        engines.clear()
        if failures:
            raise failures[0]

    def _close_record(self) -> None:
        signal_, record = self._signal, self._own_record
        self._signal = self._own_record = None
        if signal_ is not None:
            signal_.close()
        if record is not None:
            record.close()

    def close(self) -> None:
        """Free the workspace, the flight record and the gloo group. Idempotent.

        When it returns, every workspace segment is unmapped and its memory given back, whatever
        Works the caller still holds (they end with the error recorded for them: a collective
        dropped from the queue, cut short); only a symmetric heap whose tensors the caller still
        holds stays, until the last of them is freed (docs/reliability.md). Nothing it leaves
        refers back to the communicator, which goes with its last reference.

        Every step is tried past one that fails (a broken communicator's device may refuse its
        synchronize: the rest is still freed), and the first failure is raised after the last."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        failures: list[BaseException] = []
        try:
            _attempt(self._progress.close, failures)  # before the workspace goes: its collectives run on it
            self._let_go()
            _attempt(self._close_engines, failures)
            _attempt(self._close_record, failures)
        finally:
            try:
                self._fallback.close()
            finally:
                if not _LIVE:  # no communicator left to watch: no gpucomm thread outlives the last one
                    stop_watchdog()
        if failures:
            raise failures[0]

    def _let_go(self) -> None:
        """Drop what holds the workspaces or the Works of calls: the kept launches and the
        watchdog's queues of this communicator."""
        self._repeat.clear()
        for queue in (self._progress, self._fallback, *self._engines.values()):
            forget_watched(queue)

    def _release_threads(self) -> None:
        """At exit: stop gloo's threads now, leave the workspaces to the process's end."""
        self._closed = True
        _LIVE.discard(self)
        # Joined, for a bounded time: a thread still inside a torch call when the interpreter
        # finalises aborts the process (gpucomm.progress.wait_gloo).
        self._progress.close(wait=True, timeout=_EXIT_JOIN_S)
        try:
            for engine in self._engines.values():
                if engine.inter is not None:
                    engine.inter.close()
        finally:
            self._fallback.close()

    def paths(self) -> dict[str, str]:
        """What serves the tensors of each device type, in words: ``{"cpu": "workspace
        transport=shm kernels=torch", "cuda": "gloo"}`` (collectives the workspace does not serve
        go to gloo whatever this says)."""
        types = ["cpu", "cuda"] if self.device is not None else ["cpu"]
        described = {}
        for device_type in types:
            engine = self._engines.get(device_type)
            if engine is None:
                described[device_type] = "gloo"
            else:
                described[device_type] = f"workspace transport={engine.transport} kernels={_label(engine.kernels)}"
        return described

    def status(self) -> NodeStatus:
        """What every rank of this rank's node is doing now (:func:`gpucomm.status`)."""
        if self._closed:
            raise GpucommError("gpucomm.status: this communicator is closed")
        return node_status(self._flight, self.global_ranks[self.rank])

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def new_subgroup(
        self,
        ranks: Sequence[int],
        timeout: float | None = None,
        sort: bool = True,
        fn: str = "new_group",
        **knobs: object,
    ) -> Communicator | None:
        """Collective over this communicator: the members of ``ranks`` get a Communicator, the rest None.

        ``timeout`` (seconds) replaces this communicator's for the subgroup's calls; ``sort=False``
        numbers the members in the order given; ``knobs`` (transport, ...) override this
        communicator's for the subgroup.
        """
        for r in ranks:
            check_rank(r, self.world_size, "new_group", "ranks[i]")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"gpucomm.new_group: ranks must be distinct, got {list(ranks)}")
        ranks = sorted(ranks) if sort else list(ranks)
        self._subgroups += 1
        if self.rank not in ranks:
            return None
        global_ranks = [self.global_ranks[r] for r in ranks]
        return self.subgroup(
            self.store, f"{self.prefix}g{self._subgroups}/", ranks.index(self.rank), global_ranks, timeout, fn, **knobs
        )

    def subgroup(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        global_ranks: Sequence[int],
        timeout: float | None = None,
        fn: str = "new_group",
        **knobs: object,
    ) -> Communicator:
        """A subgroup of this communicator's ranks whose members agreed on ``store`` and
        ``prefix`` already (torch's name of the group: gpucomm.distributed.backend); collective over its
        members only. It keeps this communicator's device, node layout, knobs (but ``timeout``
        and ``knobs``) and flight record."""
        if timeout is not None:
            timeout = check_timeout(timeout, fn)
        return Communicator(
            store,
            rank,
            len(global_ranks),
            prefix=prefix,
            config=dataclasses.replace(self.config, **knobs, **({} if timeout is None else {"timeout": timeout})),
            local_rank=self.local_rank,
            local_world_size=self.local_world_size,  # nodes are global_rank // local_world_size
            global_ranks=list(global_ranks),
            device=self.device,
            flight=self._flight.record,
            fn=fn,
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the process is exiting)."""
        return self._closed

    def check(self) -> None:
        """Raise the error that ended a collective of this communicator, if one did, without
        waiting for anything: a kernel's record of a timeout or a mismatch (from a collective
        replayed in a CUDA graph too, which no Work watches), or a failure the watchdog found.
        The communicator is broken from then on, as after any failure."""
        if self._broken is not None:
            self._check_usable("check")
        for engine in self._engines.values():
            try:
                engine.executor.check()
            except GpucommError as err:
                self._broken = err
                raise

    def device_context(self, device: object = None) -> DeviceContext:
        """The context that kernels written with :mod:`gpucomm.language` take (one per device
        type, built on first use): this rank, the world size, every rank's flag bank and the
        bases of the symmetric memory, the stage, the error records and the timeout. The
        symmetric heap's bases join the table when the heap opens (the first :meth:`empty`),
        whether that comes before or after this call: making the context opens nothing.

        ``device`` (default: this rank's GPU where there is one, else the CPU) picks the
        workspace: CUDA tensors' (CUDA IPC), or CPU tensors' (shared memory, where kernels run
        under ``TRITON_INTERPRET=1``). A timeout inside such a kernel fails the context, not the
        communicator: see :class:`gpucomm.language.DeviceContext`.
        """
        fn = "device_context"
        self._check_usable(fn)
        kind = torch.device(device).type if device is not None else "cuda" if self.device is not None else "cpu"
        engine = self._engines.get(kind)
        if engine is None:
            raise UnsupportedError(
                f"gpucomm.{fn}: no device API for {kind} tensors of this communicator: gloo serves them (no workspace)"
            )
        return engine.device_context(fn)

    def graph_safe(self) -> bool:
        """Whether collectives on CUDA tensors of this communicator can be captured in a CUDA
        graph now: a GPU workspace that runs the program kernel, and no failure so far. Run each
        collective once, eagerly, before capturing it: its program is built on first use."""
        engine = self._engines.get("cuda")
        return engine is not None and engine.kernels.name != "torch" and self._broken is None and not self._closed

    def graph_capture(self, graph: object = None) -> contextlib.AbstractContextManager[None]:
        """Around CUDA graph captures: the all_reduces and broadcasts captured on ordinary tensors
        run in place at replay, with no copy in or out, where every rank's tensor can be shared
        (``GPUCOMM_DEBUG=INFO`` says why not, per call); leaving with no error registers them
        (:meth:`register_graph_buffers` with ``graph``). Collective."""
        return capturing_in_place(self, graph)

    def register_graph_buffers(self, graph: object = None) -> None:
        """What :meth:`graph_capture` does on leaving, before any replay: the ranks exchange, once,
        the IPC handles of the segments of the calls captured in place since the last registration,
        open each peer segment once and fill the captured kernels' operand tables with the peers'
        addresses (:mod:`gpucomm.workspace.graph_buffers`). The segments stay open until ``graph``
        is freed (where given) or this communicator closes. Collective."""
        register(self, graph)
