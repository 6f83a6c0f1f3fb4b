"""``Communicator``: one group of ranks and every collective on it, without global state.

Each call is validated first (nothing moves before the inputs are known good), then served by
one of two paths:

- the *workspace* path (``gpucomm.workspace.engine``): gpucomm's own kernels over the symmetric workspace
  (CUDA IPC for CUDA tensors, POSIX shared memory for CPU tensors with ``GPUCOMM_TRANSPORT=shm``);
- the *fallback* path (``gpucomm.gloo.fallback``): gloo, built on gpucomm's own store.

Ranks given to a Communicator's methods (src, dst, root) are ranks of this communicator.
All ranks of the group must call each collective, in the same order.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import signal
import weakref
import zlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from gpucomm import log
from gpucomm.capture import capturing
from gpucomm.comm import dtypes
from gpucomm.comm.rendezvous import draw_prefix
from gpucomm.comm.validation import (
    check_numel,
    check_rank,
    check_same,
    check_splits,
    check_tensor,
    check_tensor_list,
    separate,
)
from gpucomm.config import Config
from gpucomm.errors import (
    CommBrokenError,
    CommMismatchError,
    CommTimeoutError,
    GpucommError,
    UnsupportedError,
    WorkspaceUnavailableError,
)
from gpucomm.gloo.fallback import GlooFallback
from gpucomm.language.context import DeviceContext
from gpucomm.ops.registry import kernels_run_on_cpu
from gpucomm.progress import Progress, Queued
from gpucomm.reduce_op import ReduceOp, as_reduce_op, premul_factor
from gpucomm.reliability.flight import FlightLog, FlightRecord, group_label
from gpucomm.reliability.liveness import Liveness
from gpucomm.reliability.story import NodeStatus, StatusSignal, mismatch_story, node_status, timeout_story
from gpucomm.reliability.watchdog import stop as stop_watchdog
from gpucomm.reliability.watchdog import watch
from gpucomm.transport.heap import SymmetricHeap
from gpucomm.transport.pool import SymmetricPool
from gpucomm.work import StreamEnd, Work
from gpucomm.workspace.engine import Engine
from gpucomm.workspace.repeat import Repeats

__all__ = ["Communicator", "release_all"]

_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
# Collectives whose tensors may differ in size between ranks (split sizes, per-pair lists).
_UNEVEN_SIZES = ("all_to_all", "all_to_all_single")
# How gloo words a peer that died or never came: "Timed out waiting ...", "Connection closed by
# peer", "Connection reset by peer", "Socket closed", "Broken pipe".
_GLOO_PEER_FAILURES = (
    "imed out",
    "onnection closed",
    "onnection reset",
    "ocket closed",
    "roken pipe",
    "Read error",
    "Write error",
)


# Communicators not closed yet: their threads are stopped at exit (release_all).
_LIVE: weakref.WeakSet[Communicator] = weakref.WeakSet()


def release_all() -> None:
    """Stop every thread gpucomm started, for a process that exits (whether or not it destroyed
    its groups): the watchdog first (it asks gloo's works), then each open communicator's
    progress thread and gloo's threads (the inter-node groups' too). Nothing collective happens:
    peers may be gone already, and the process's exit frees the workspaces."""
    stop_watchdog()
    for comm in list(_LIVE):
        comm._release_threads()


def _attempt(step: Callable[[], object], failures: list[BaseException]) -> None:
    """Run one step of a close, keeping its failure for after the rest (a CUDA error is a
    RuntimeError, as are gpucomm's own; a file or socket refusal an OSError)."""
    try:
        step()
    except (RuntimeError, OSError) as exc:
        failures.append(exc)


def _rank_device(local_rank: int) -> torch.device | None:
    """This rank's GPU: LOCAL_RANK modulo the visible devices (several ranks may share one)."""
    if not torch.cuda.is_available():
        return None
    return torch.device("cuda", local_rank % torch.cuda.device_count())


class Communicator:
    """A group of ``world_size`` ranks; this process is ``rank``.

    Build one with :func:`gpucomm.init_process_group` (the default group) or
    :func:`gpucomm.new_group`, or directly from a store::

        store = torch.distributed.TCPStore("127.0.0.1", 29500, 2, rank == 0)
        with gpucomm.Communicator(store, rank, 2) as comm:
            comm.all_reduce(t)
    """

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
    ) -> None:
        """``prefix``: where its keys live in ``store``; None draws a fresh one from the store
        (collective), so that communicators built on one store never read each other's keys.
        ``flight``: the flight record of the parent communicator (a subgroup writes its calls
        into it); None opens this communicator's own (collective)."""
        self.config = config if config is not None else Config.from_env()
        log.enable(self.config.debug)
        self.rank = check_rank(rank, world_size, "Communicator", "rank")
        self.world_size = world_size
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(world_size))
        self.local_rank = rank if local_rank is None else local_rank
        self.local_world_size = world_size if local_world_size is None else local_world_size
        if self.config.local_world_size is not None:
            self.local_world_size = self.config.local_world_size
        self.store = store
        if prefix is None:
            prefix = draw_prefix(store, self.rank, world_size, self.config.timeout, "Communicator")
        self.prefix = prefix
        # device: the GPU this rank was pinned to (init_process_group(device_id=...)); by default
        # the one of its local rank.
        self.device = device if device is not None else _rank_device(self.local_rank)
        self.timeout = self.config.timeout
        self._subgroups = 0
        self._calls = 0  # collective calls so far: equal on all ranks for the same call
        # Blocking all_reduce calls seen before, by (address, count, dtype, op): the launch of
        # their program on their buffers, every decision taken (gpucomm.workspace.repeat).
        self._repeat = Repeats()
        self._broken: BaseException | None = None
        self._closed = False
        self._liveness = Liveness(store, prefix, rank, world_size)
        self._fallback = GlooFallback(dist.PrefixStore(prefix + "gloo/", store), rank, world_size, self.timeout)
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

    # -- life cycle ---------------------------------------------------------------------------
    def _workspace_plan(self) -> dict[str, tuple[str, str]]:
        """Which transport and kernels serve the tensors of each device type (the rest: gloo).

        ``auto``: CUDA tensors on the CUDA IPC workspace, CPU tensors on the shared-memory one when
        every rank runs on this host. A transport named explicitly serves its own device type and
        must work. The kernels knob applies where it can: CPU tensors run the torch kernels unless
        the Triton interpreter is on, whatever kernels a GPU uses.
        """
        config = self.config
        if config.kernels == "cuda" and self.device is None:
            raise UnsupportedError("gpucomm: GPUCOMM_KERNELS=cuda needs a CUDA device, and this host has none")
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

        Every step is tried past one that fails (a broken communicator's device may refuse its
        synchronize: the rest is still freed), and the first failure is raised after the last."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        failures: list[BaseException] = []
        try:
            _attempt(self._progress.close, failures)  # before the workspace goes: its collectives run on it
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

    def _release_threads(self) -> None:
        """At exit: stop gloo's threads now, leave the workspaces to the process's end."""
        self._closed = True
        _LIVE.discard(self)
        self._progress.close(wait=False)
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
                described[device_type] = f"workspace transport={engine.transport} kernels={engine.kernels.name}"
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
        self, ranks: Sequence[int], timeout: float | None = None, sort: bool = True, **knobs: object
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
            self.store, f"{self.prefix}g{self._subgroups}/", ranks.index(self.rank), global_ranks, timeout, **knobs
        )

    def subgroup(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        global_ranks: Sequence[int],
        timeout: float | None = None,
        **knobs: object,
    ) -> Communicator:
        """A subgroup of this communicator's ranks whose members agreed on ``store`` and
        ``prefix`` already (torch's name of the group: gpucomm.distributed.backend); collective over its
        members only. It keeps this communicator's device, node layout, knobs (but ``timeout``
        and ``knobs``) and flight record."""
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
        )

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or the process is exiting)."""
        return self._closed

    # -- symmetric tensors --------------------------------------------------------------------
    def empty(self, *size: object, dtype: torch.dtype | None = None, device: object = None) -> torch.Tensor:
        """A tensor (``torch.empty``'s arguments) in the node's symmetric heap: an ordinary torch
        tensor whose memory every rank of the node has mapped, at the same offset on every rank.

        Collective: every rank of this communicator calls it with the same size and dtype, in
        the same order as its other allocations (ranks that differ raise CommMismatchError).
        The first call opens the heap (GPUCOMM_HEAP_BYTES per rank; nothing of it exists
        before): where the host has no room for it (a small /dev/shm) every rank raises
        WorkspaceUnavailableError, and the communicator's collectives go on working.
        Collectives on such a tensor (all_reduce: two-shot) read the peers' copies in place,
        with no copy through the workspace; any other tensor takes the usual path. A contiguous
        slice of a symmetric tensor is symmetric too when every rank slices alike. The memory is
        freed when the last tensor or view of it is gone (gpucomm.transport.heap).

        Args:
            size: ints, or one sequence of them, as torch.empty takes.
            dtype: default ``torch.get_default_dtype()``.
            device: ``"cpu"`` or this rank's GPU; default this rank's GPU where it has one, else
                the CPU (whose heap is shared memory).

        Example::

            grad = comm.empty(4096, dtype=torch.bfloat16)
            grad.copy_(local_grad)
            comm.all_reduce(grad)   # reads every rank's grad where it is
        """
        self._check_usable("empty")
        shape = _shape_of(size, "empty")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"gpucomm.empty: dtype must be a torch.dtype, got {type(dtype).__name__}")
        where = torch.device(device) if device is not None else (self.device or torch.device("cpu"))
        if where.type == "cuda" and self.device is not None and where.index is None:
            where = self.device
        engine = self._engines.get(where.type)
        if engine is None:
            raise UnsupportedError(
                f"gpucomm.empty: {where.type} tensors of this group are served by gloo, which has no symmetric heap "
                "(on one host, GPUCOMM_TRANSPORT=auto or shm serves CPU tensors from shared memory)"
            )
        if where.type == "cuda" and where != engine.device:
            raise ValueError(f"gpucomm.empty: device must be this rank's GPU {engine.device}, got {where}")
        heap = self._engine_heap(engine, "empty")
        if heap is None:
            raise UnsupportedError(
                f"gpucomm.empty: this group has no symmetric heap for {where.type} tensors (GPUCOMM_HEAP_BYTES=0)"
            )
        return heap.empty(shape, dtype)

    def mem_pool(self, nbytes: int, device: object = None) -> SymmetricPool:
        """A pool of ``nbytes`` of the node's symmetric heap whose ``mem_pool()`` is a
        ``torch.cuda.MemPool``: ``with torch.cuda.use_mem_pool(pool.mem_pool()):`` puts torch's
        allocations (gradient buckets, activations) in the heap, at the same offsets on every rank
        that allocates alike (gpucomm.transport.pool). Collective; one per process.

        Example::

            pool = comm.mem_pool(256 << 20)
            with torch.cuda.use_mem_pool(pool.mem_pool()):
                grads = torch.empty(4096, device="cuda")
            pool.check()                 # collective: every rank allocated alike
            comm.all_reduce(grads)       # in place, as on a tensor of comm.empty
        """
        self._check_usable("mem_pool")
        heap = self._open_heap(device, "mem_pool")
        if heap is None:
            raise UnsupportedError(
                "gpucomm.mem_pool: this group has no symmetric heap for that device (see gpucomm.empty)"
            )
        engine = self._engines[heap.device.type]
        return SymmetricPool(heap, nbytes, self.store, engine.heap_prefix, self.timeout)

    def heap(self, device: object = None) -> SymmetricHeap | None:
        """The symmetric heap of ``device``'s tensors on this rank's node (None without one):
        its table of every rank's base address, for kernels that address peers (gpucomm.language).
        Collective the first time (it opens the heap, as :meth:`empty` does)."""
        return self._open_heap(device, "heap")

    def _open_heap(self, device: object, fn: str) -> SymmetricHeap | None:
        where = torch.device(device) if device is not None else (self.device or torch.device("cpu"))
        engine = self._engines.get(where.type)
        return None if engine is None else self._engine_heap(engine, fn)

    def _engine_heap(self, engine: Engine, fn: str) -> SymmetricHeap | None:
        """``engine``'s heap, opened now if it was not (collective, :meth:`Engine.open_heap`)."""
        if engine.heap is not None:
            return engine.heap
        heap = engine.open_heap(fn)
        # The heap's memory is new, maybe at addresses where ordinary tensors lay before: the
        # launches kept for them (gpucomm.workspace.repeat, keyed by address) took the ordinary path, and
        # a symmetric tensor there must take its own.
        self._repeat.clear()
        return heap

    # -- plumbing -----------------------------------------------------------------------------
    def _check_usable(self, fn: str) -> None:
        if self._closed:
            raise GpucommError(f"gpucomm.{fn}: this communicator is closed")
        if self._broken is not None:
            raise CommBrokenError(
                f"gpucomm.{fn}: the communicator failed earlier and cannot be used until it is destroyed "
                f"(original error: {self._broken})"
            ) from self._broken

    def _translate(self, fn: str, seq: int, peer: int | None) -> Callable[[RuntimeError], BaseException]:
        """Turn a failure of call ``seq`` into gpucomm's error, and mark the communicator broken."""

        def translate(err: RuntimeError) -> BaseException:
            if isinstance(err, UnsupportedError):
                return err  # raised before anything moved (a call that cannot be captured yet)
            if isinstance(err, GpucommError):
                self._flight.failed(seq)
                self._tell(err, seq)
                self._broken = err
                return err
            text = str(err)
            if not any(sign in text for sign in _GLOO_PEER_FAILURES):
                return err
            # Stamped first: a peer still naming culprits reads that this rank failed, and does
            # not name it if it exits before they are done (gpucomm.reliability.liveness).
            self._flight.failed(seq)
            record = self._flight.record
            missing = (
                [peer]
                if peer is not None
                else self._liveness.culprits(seq, failed_first=lambda r: record.failed_last(self.global_ranks[r]))
            )
            failure = CommTimeoutError(
                fn, seq, self.rank, missing, self.timeout, detail=f"gloo: {text.splitlines()[0]}"
            )
            self._tell(failure, seq)
            self._broken = failure
            return failure

        return translate

    def _tell(self, err: GpucommError, seq: int) -> None:
        """Add what the ranks involved are doing, from the node's flight records, to ``err``."""
        if isinstance(err, CommTimeoutError) and err.missing:
            err.tell(timeout_story(self._flight, self, err.missing))
        elif isinstance(err, CommMismatchError) and err.peers:
            err.tell(mismatch_story(self._flight, self, seq, err.peers))

    def _run(
        self,
        fn: str,
        tensor: torch.Tensor | None,
        async_op: bool,
        serve: Callable[[object], Work],
        finish: Callable[[], None] | None = None,
        outputs: Sequence[torch.Tensor] = (),
        blocking: bool = False,
        **fields: object,
    ) -> Work | None:
        """Route one validated call to a path, check that all ranks agree on it, log it, run it.

        ``tensor`` is what travels (the wire form from :mod:`gpucomm.comm.dtypes`); ``finish`` runs
        once the path's work is complete (writing a staged result back into the caller's tensor);
        ``outputs`` are the caller's tensors that ``Work.result()`` returns.
        """
        peer = fields.get("peer") if fn in _POINT_TO_POINT else None
        if fn not in _POINT_TO_POINT:
            self._calls += 1
        translate = self._translate(fn, self._calls, peer)  # type: ignore[arg-type]
        # A barrier has no tensor: it waits on the host's workspace where there is one, so that it
        # returns once every rank has arrived, as torch.distributed's does.
        engine = self._engines.get("cpu" if tensor is None else tensor.device.type)
        if engine is None and tensor is None and self._engines:
            engine = next(iter(self._engines.values()))
        algo = engine.serves(fn, tensor) if engine is not None else None
        if log.logger.isEnabledFor(logging.INFO):
            detail = {"path": "gloo"} if algo is None else {"path": "workspace", **engine.describe(algo)}
            log.logger.info(log.describe_call(self.rank, fn, tensor, **fields, **detail))
        if tensor is not None and capturing(tensor.device):
            self._check_capturable(fn, engine, algo)
        # An asynchronous call that would wait in the caller's thread (the host workspace runs it
        # there; a checked gloo call agrees on fingerprints before gloo's collective may start),
        # or any call behind one, runs on the progress thread, in call order.
        host = algo is not None and engine.stream is None
        waits = host or (algo is None and self.config.check != "off")
        queued = waits and fn not in _POINT_TO_POINT and (async_op or self._progress.busy())
        if host and fn in _POINT_TO_POINT:
            self._progress.drain()
        slot = self._flight.entered(self._calls, fn, tensor, fields)
        on_stream = algo is not None and engine.stream is not None and async_op
        side_stream = None
        try:
            if algo is not None and engine.stream is not None:
                # A blocking call launches on the caller's current stream, an asynchronous one on
                # the engine's (gpucomm.workspace.stream_order keeps them in call order).
                on = self._on_stream if async_op else self._on_caller_stream
                pending = on(fn, engine, _Planned(engine, algo), serve, finish)
                finish = None  # queued on the stream after the collective
                side_stream = engine.side_stream if async_op else None
            else:
                # gloo's works run on gloo's threads (a checked call's fingerprints travel in its
                # first exchange: gpucomm.gloo.checked); the host workspace runs in this thread (a
                # collective has run on return, send/recv progress in wait()).
                path: object = self._fallback
                if algo is not None:
                    path = _Planned(engine, algo)
                elif fn not in _POINT_TO_POINT and self.config.check != "off":
                    path = self._fallback.checked(_fingerprint(fn, tensor, fields), self._describe(fn, tensor, fields))
                if queued:  # on the progress thread, in call order (gpucomm.progress)
                    pending = [self._progress.submit(Queued(functools.partial(_to_end, serve, path), fn, self.rank))]
                else:
                    pending = [serve(path)]
        except RuntimeError as err:
            raise translate(err) from err
        work = Work(
            pending,
            finish,
            translate,
            outputs=outputs,
            blocking=blocking or self.config.blocking_wait,
            keep=(serve, finish),  # what the collective's buffers hang on, until it is complete
            side_stream=side_stream,
        )
        if (on_stream and not capturing(engine.device)) or (async_op and (algo is None or queued)):
            # Works of one queue end in its order: a stream's, the progress thread's, a gloo group's.
            queue = engine if on_stream else self._progress if queued else self._fallback
            watch(work, fn, self.timeout, self._fail, self.rank, queue=queue)
        if async_op:
            self._flight.completes_with(slot, work)
            return work
        work.wait()
        self._flight.completed(slot)
        return None

    def _on_stream(
        self,
        fn: str,
        engine: Engine,
        path: _Planned,
        serve: Callable[[object], Work],
        finish: Callable[[], None] | None,
    ) -> list[object]:
        """Queue a collective on the engine's CUDA stream, after the caller's stream and this
        communicator's launches so far; returns what its Work waits for: the path's Work and the
        event recorded after the collective (and after its write-back, when it has one)."""
        with engine.on_stream():
            inner = serve(path)
            if finish is not None:
                finish()
            end = torch.cuda.Event()
            end.record(engine.stream)
        return [inner, StreamEnd(end, engine.stream, engine.executor.check, fn, self.rank)]

    def _on_caller_stream(
        self,
        fn: str,
        engine: Engine,
        path: _Planned,
        serve: Callable[[object], Work],
        finish: Callable[[], None] | None,
    ) -> list[object]:
        """Queue a blocking collective on the caller's current stream, after this communicator's
        launches so far, and its write-back after it there; the host goes on at once. Returns
        what its Work waits for.

        No end event, no watchdog: a kernel's error record is raised by the communicator's next
        call (every launch looks first), ``check()`` or a later Work's wait. With
        GPUCOMM_BLOCKING_WAIT=1 an end event lets the host wait for the collective here."""
        engine.on_caller_stream()
        inner = serve(path)
        if finish is not None:
            finish()
        if not self.config.blocking_wait or capturing(engine.device):
            return [inner]
        stream = torch.cuda.current_stream(engine.device)
        end = torch.cuda.Event()
        end.record(stream)
        return [inner, StreamEnd(end, stream, engine.executor.check, fn, self.rank)]

    def _check_capturable(self, fn: str, engine: Engine | None, algo: str | None) -> None:
        """A collective captured into a CUDA graph must run entirely on the device."""
        reason = None
        if algo is None:
            reason = "it is served by gloo here"
        elif engine.kernels.name == "torch":
            reason = "the torch kernels wait on the host (use GPUCOMM_KERNELS=triton or cuda)"
        elif fn in _POINT_TO_POINT or fn in _UNEVEN_SIZES or algo == "hierarchical":
            reason = "its schedule is decided on the host between launches"
        if reason is not None:
            raise UnsupportedError(f"gpucomm.{fn}: cannot be captured in a CUDA graph: {reason}")

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

    def _fail(self, error: BaseException) -> None:
        """The watchdog found ``error``: the communicator is broken from now on; one line says
        why; with GPUCOMM_ASYNC_ERROR_HANDLING=abort the process ends here."""
        if self._closed:
            return  # a collective cut short by destroy_process_group is no news
        if self._broken is None:
            self._broken = error
        log.logger.error(f"gpucomm[rank {self.rank}]: watchdog: {error}")
        if self.config.async_error_handling == "abort":
            logging.shutdown()
            os.abort()

    def _describe(self, fn: str, tensor: torch.Tensor | None, fields: dict[str, object]) -> Callable[[list[int]], str]:
        """The words of a gloo-path mismatch of this call, given the ranks that called something else."""
        call = self._calls

        def describe(differ: list[int]) -> str:
            options = ", ".join(f"{k}={v}" for k, v in fields.items()) or "no options"
            size = "" if tensor is None else f", {tensor.numel()} x {tensor.dtype}"
            return (
                f"gpucomm.{fn} call {call}: rank {self.rank} called {fn} with {options}{size}, but rank(s) {differ} "
                f"called something else (a different collective, size, dtype, op or root)\n"
                + mismatch_story(self._flight, self, call, differ)
            )

        return describe

    # -- collectives --------------------------------------------------------------------------
    # Each method validates the caller's tensors, then hands the path their wire form
    # (gpucomm.comm.dtypes): the tensors themselves for the six native dtypes, byte views for data
    # movement, accumulation-type copies for reductions, written back once at the end.
    # A call's buffers that overlap give the separate-buffer result: what overlaps is staged
    # (gpucomm.comm.validation.separate; docs/reliability.md, "Overlapping buffers"), torch's
    # in-place forms run as they are.
    def all_reduce(self, tensor: torch.Tensor, op: object = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over all ranks, in place, on every rank.

        All ranks in the group must call this simultaneously.

        Deterministic by contract on the workspace path: each element of the result depends
        only on that element's inputs on every rank, its dtype and op, and the group's layout
        (ranks, and ranks per node); never on the message size, the algorithm (chosen, or forced
        by GPUCOMM_ALGO: only ring and tree leave the contract, and warn), the channels, the
        kernels (Triton, CUDA C++, torch), the order in which ranks arrive, or the run. The
        ranks of a node fold in rank order in the accumulation type (fp32 for 16-bit floats and
        float8) and the result is rounded once; AVG divides once, after the fold; across nodes
        the nodes' folds meet in node order. PREMUL_SUM multiplies each rank's tensor first,
        in its dtype (float8 in fp32), then sums under the same contract. MIN and MAX are
        exact, and so are integer SUM and PRODUCT (wrapping), in any order; a floating-point
        PRODUCT folds in rank order like SUM. The gloo path
        keeps it for calls that fit its checked exchange (gpucomm.gloo.checked) and uses
        gloo's own order beyond. docs/algorithms.md, "Deterministic reductions", has the rule.

        Args:
            tensor: input and output; contiguous, any dtype of :data:`gpucomm.comm.dtypes.REDUCIBLE`.
            op: a ReduceOp (SUM, PRODUCT, MIN, MAX, AVG) or ``ReduceOp.PREMUL_SUM(factor)``.
            async_op: return a Work instead of waiting.
        """
        fn = "all_reduce"
        if not async_op:
            seen = self._repeat.find(tensor, op)
            if seen is not None and self._broken is None and not self._closed and self._progress.idle():
                self._calls += 1
                slot = self._flight.enter(self._calls, seen.flight)
                try:
                    seen.launch()
                except RuntimeError as err:
                    raise self._translate(fn, self._calls, None)(err) from err
                self._flight.completed(slot)
                return None
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        rop, scale, name = _operator(op, fn)
        st = dtypes.staged([tensor], rop, fn, scale)
        wire = st.wire[0]
        work = self._run(
            fn,
            wire,
            async_op,
            lambda p: p.all_reduce(wire, st.op),
            st.write_back,
            [tensor],
            op=name,
            **_sent_as(tensor, wire),
        )
        if not async_op and wire is tensor and scale is None:
            self._repeat.learn(
                self._engines.get(tensor.device.type), self.config, self._flight, tensor, op, rop, {"op": name}
            )
        return work

    def reduce(
        self, tensor: torch.Tensor, dst: int = 0, op: object = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        """Reduce ``tensor`` over all ranks into ``tensor`` on ``dst``; other ranks' tensors are unchanged.

        Deterministic by contract, as :meth:`all_reduce`: every element on ``dst`` has the
        bits all_reduce would give it, whichever rank is the root.
        """
        fn = "reduce"
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        check_rank(dst, self.world_size, fn, "dst")
        rop, scale, name = _operator(op, fn)
        st = dtypes.staged([tensor], rop, fn, scale)
        wire = st.wire[0]
        finish = st.write_back if self.rank == dst else None
        return self._run(
            fn,
            wire,
            async_op,
            lambda p: p.reduce(wire, dst, st.op),
            finish,
            [tensor],
            op=name,
            root=dst,
            **_sent_as(tensor, wire),
        )

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Work | None:
        """Copy ``tensor`` of ``src`` into ``tensor`` on every rank."""
        fn = "broadcast"
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        check_rank(src, self.world_size, fn, "src")
        wire = dtypes.as_bytes(tensor)
        return self._run(
            fn, wire, async_op, lambda p: p.broadcast(wire, src), None, [tensor], root=src, **_sent_as(tensor, wire)
        )

    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False) -> Work | None:
        """``tensor_list[i]`` = ``tensor`` of rank i, on every rank.

        In place: ``tensor`` is ``tensor_list[rank]``. Entries that overlap each other are
        received apart and copied in list order (the last listed wins)."""
        fn = "all_gather"
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        outputs = check_tensor_list(tensor_list, self.world_size, fn, "tensor_list", tensor, self.device)
        sep = separate([tensor], outputs, {(0, self.rank): 0})
        wire, wire_outs = dtypes.as_bytes(sep.inputs[0]), [dtypes.as_bytes(t) for t in sep.outputs]
        finish = sep.write_back if sep.staged else None
        return self._run(
            fn, wire, async_op, lambda p: p.all_gather(wire_outs, wire), finish, outputs, **_sent_as(tensor, wire)
        )

    def all_gather_into_tensor(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        """``output_tensor`` = the inputs of all ranks concatenated along dim 0 (rank order).

        In place: ``input_tensor`` is this rank's chunk of ``output_tensor``. An input that
        overlaps the output otherwise is copied aside first (the separate-buffer result)."""
        fn = "all_gather_into_tensor"
        self._check_usable(fn)
        check_tensor(input_tensor, fn, "input_tensor", self.device)
        check_tensor(output_tensor, fn, "output_tensor", self.device)
        check_same(output_tensor, input_tensor, fn, "output_tensor")
        check_numel(output_tensor, input_tensor.numel() * self.world_size, fn, "output_tensor (world_size x input)")
        sep = separate(
            [input_tensor], [output_tensor], {(0, 0): self.rank * input_tensor.numel() * input_tensor.element_size()}
        )
        wire_in, wire_out = dtypes.as_bytes(sep.inputs[0]), dtypes.as_bytes(output_tensor)
        return self._run(
            fn,
            wire_in,
            async_op,
            lambda p: p.all_gather_into_tensor(wire_out, wire_in),
            None,
            [output_tensor],
            **_sent_as(input_tensor, wire_in),
        )

    def gather(
        self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, async_op: bool = False
    ) -> Work | None:
        """``gather_list[i]`` on ``dst`` = ``tensor`` of rank i; other ranks pass no list."""
        fn = "gather"
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        check_rank(dst, self.world_size, fn, "dst")
        outputs = None
        if self.rank == dst:
            if gather_list is None:
                raise ValueError(f"gpucomm.{fn}: gather_list is required on the destination rank {dst}")
            outputs = check_tensor_list(gather_list, self.world_size, fn, "gather_list", tensor, self.device)
        elif gather_list:
            raise ValueError(
                f"gpucomm.{fn}: gather_list must be None or empty on rank {self.rank}, which is not the destination {dst}"
            )
        sep = separate([tensor], outputs or [], {(0, dst): 0})
        wire, wire_outs = (
            dtypes.as_bytes(sep.inputs[0]),
            None if outputs is None else [dtypes.as_bytes(t) for t in sep.outputs],
        )
        finish = sep.write_back if sep.staged else None
        return self._run(
            fn,
            wire,
            async_op,
            lambda p: p.gather(wire, wire_outs, dst),
            finish,
            outputs or [],
            root=dst,
            **_sent_as(tensor, wire),
        )

    def scatter(
        self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, async_op: bool = False
    ) -> Work | None:
        """``tensor`` on rank i = ``scatter_list[i]`` of ``src``."""
        fn = "scatter"
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        check_rank(src, self.world_size, fn, "src")
        inputs = None
        if self.rank == src:
            if scatter_list is None:
                raise ValueError(f"gpucomm.{fn}: scatter_list is required on the source rank {src}")
            checked = check_tensor_list(scatter_list, self.world_size, fn, "scatter_list", tensor, self.device)
            inputs = [dtypes.as_bytes(t) for t in separate(checked, [tensor], {(src, 0): 0}).inputs]
        elif scatter_list:
            raise ValueError(
                f"gpucomm.{fn}: scatter_list must be None or empty on rank {self.rank}, which is not the source {src}"
            )
        wire = dtypes.as_bytes(tensor)
        return self._run(
            fn,
            wire,
            async_op,
            lambda p: p.scatter(wire, inputs, src),
            None,
            [tensor],
            root=src,
            **_sent_as(tensor, wire),
        )

    def reduce_scatter(
        self, output: torch.Tensor, input_list: list[torch.Tensor], op: object = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        """``output`` on rank i = the reduction over ranks of ``input_list[i]``.

        Deterministic by contract, as :meth:`all_reduce`: every element has the bits that
        all_reduce of the concatenated inputs would give it.
        """
        fn = "reduce_scatter"
        self._check_usable(fn)
        check_tensor(output, fn, "output", self.device)
        inputs = separate(
            check_tensor_list(input_list, self.world_size, fn, "input_list", output, self.device),
            [output],
            {(self.rank, 0): 0},
        ).inputs
        rop, scale, name = _operator(op, fn)
        out, ins = dtypes.staged([output], rop, fn), dtypes.staged(inputs, rop, fn, scale)
        wire = out.wire[0]
        return self._run(
            fn,
            wire,
            async_op,
            lambda p: p.reduce_scatter(wire, ins.wire, out.op),
            out.write_back,
            [output],
            op=name,
            **_sent_as(output, wire),
        )

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        """``output`` on rank i = the reduction over ranks of chunk i of ``input`` (dim 0).

        Deterministic by contract, as :meth:`all_reduce`: ``output`` on rank i has the bits of
        chunk i of all_reduce's result on ``input``.
        """
        fn = "reduce_scatter_tensor"
        self._check_usable(fn)
        check_tensor(output, fn, "output", self.device)
        check_tensor(input, fn, "input", self.device)
        check_same(input, output, fn, "input")
        check_numel(input, output.numel() * self.world_size, fn, "input (world_size x output)")
        rop, scale, name = _operator(op, fn)
        # In place, the output is this rank's chunk of the input.
        input = separate([input], [output], {(0, 0): -self.rank * output.numel() * output.element_size()}).inputs[0]
        out, inp = dtypes.staged([output], rop, fn), dtypes.staged([input], rop, fn, scale)
        wire, wire_in = out.wire[0], inp.wire[0]
        return self._run(
            fn,
            wire,
            async_op,
            lambda p: p.reduce_scatter_tensor(wire, wire_in, out.op),
            out.write_back,
            [output],
            op=name,
            **_sent_as(output, wire),
        )

    def all_to_all(
        self, output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], async_op: bool = False
    ) -> Work | None:
        """``output_tensor_list[j]`` on rank i = ``input_tensor_list[i]`` of rank j (sizes may differ per pair)."""
        fn = "all_to_all"
        self._check_usable(fn)
        for name, lst in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
            if not isinstance(lst, (list, tuple)) or len(lst) != self.world_size:
                got = len(lst) if isinstance(lst, (list, tuple)) else type(lst).__name__
                raise ValueError(f"gpucomm.{fn}: {name} must hold world_size = {self.world_size} tensors, got {got}")
        outputs = [
            check_tensor(t, fn, f"output_tensor_list[{i}]", self.device) for i, t in enumerate(output_tensor_list)
        ]
        inputs = [check_tensor(t, fn, f"input_tensor_list[{i}]", self.device) for i, t in enumerate(input_tensor_list)]
        for i, t in enumerate(outputs + inputs):
            check_same(t, inputs[0], fn, f"tensor {i} of the lists")
        # In place, this rank's own piece is one tensor in both lists.
        own = {(self.rank, self.rank): 0} if inputs[self.rank].numel() == outputs[self.rank].numel() else {}
        sep = separate(inputs, outputs, own)
        wire_outs, wire_ins = [dtypes.as_bytes(t) for t in sep.outputs], [dtypes.as_bytes(t) for t in sep.inputs]
        finish = sep.write_back if sep.staged else None
        return self._run(
            fn,
            wire_ins[0],
            async_op,
            lambda p: p.all_to_all(wire_outs, wire_ins),
            finish,
            outputs,
            **_sent_as(inputs[0], wire_ins[0]),
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Work | None:
        """Split ``input`` along dim 0, send split j to rank j, concatenate what arrives into ``output``.

        No in-place form: an ``input`` that overlaps ``output`` is copied aside first, so the
        result is the one separate buffers give."""
        fn = "all_to_all_single"
        self._check_usable(fn)
        check_tensor(input, fn, "input", self.device)
        check_tensor(output, fn, "output", self.device)
        check_same(output, input, fn, "output")
        if input.dim() == 0 or output.dim() == 0:
            raise ValueError(
                f"gpucomm.{fn}: input and output need at least one dimension, got shapes {tuple(input.shape)} and {tuple(output.shape)}"
            )
        if input.shape[1:] != output.shape[1:]:
            raise ValueError(
                f"gpucomm.{fn}: input and output must agree beyond dim 0, got {tuple(input.shape)} and {tuple(output.shape)}"
            )
        in_splits = check_splits(input_split_sizes, self.world_size, input.shape[0], fn, "input_split_sizes")
        out_splits = check_splits(output_split_sizes, self.world_size, output.shape[0], fn, "output_split_sizes")
        # No in-place form (NCCL refuses an aliased alltoall): an input that overlaps the output
        # is copied aside. The byte view keeps dim 0, so the split sizes (rows) stay as they are.
        wire_in, wire_out = dtypes.as_bytes(separate([input], [output]).inputs[0]), dtypes.as_bytes(output)
        return self._run(
            fn,
            wire_in,
            async_op,
            lambda p: p.all_to_all_single(wire_out, wire_in, out_splits, in_splits),
            None,
            [output],
            **_sent_as(input, wire_in),
        )

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to ``dst``; matched by a ``recv`` with the same tag on ``dst``."""
        self._p2p("send", tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> int:
        """Receive into ``tensor`` from ``src`` (any rank if None); returns the sender's rank."""
        work = self._p2p("recv", tensor, src, tag)
        work.wait()
        return work.source if work.source is not None else src  # type: ignore[return-value]

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Work:
        """Start sending ``tensor`` to ``dst`` and return at once; ``wait()`` on the Work completes it."""
        return self._p2p("isend", tensor, dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int | None = None, tag: int = 0) -> Work:
        """Post a receive into ``tensor`` and return at once; after ``wait()``, ``source`` names the sender."""
        return self._p2p("irecv", tensor, src, tag)

    def _p2p(self, fn: str, tensor: torch.Tensor, peer: int | None, tag: int) -> Work:
        sending = fn.endswith("send")
        self._check_p2p(fn, tensor, peer, "dst" if sending else "src", tag)
        wire = dtypes.as_bytes(tensor)
        extra = _sent_as(tensor, wire)
        if sending:
            return self._run(
                fn, wire, True, lambda p: p.send(wire, peer, tag), None, [tensor], peer=peer, tag=tag, **extra
            )  # type: ignore[return-value]
        return self._run(fn, wire, True, lambda p: p.recv(wire, peer, tag), None, [tensor], peer=peer, tag=tag, **extra)  # type: ignore[return-value]

    def _check_p2p(self, fn: str, tensor: torch.Tensor, peer: int | None, name: str, tag: int) -> None:
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        if peer is not None or name == "dst":
            check_rank(peer, self.world_size, fn, name)
            if peer == self.rank:
                raise ValueError(f"gpucomm.{fn}: {name} must be another rank, got this rank's own {peer}")
        if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
            raise ValueError(f"gpucomm.{fn}: tag must be a non-negative int, got {tag!r}")

    def barrier(self, async_op: bool = False) -> Work | None:
        """Return once every rank has entered the barrier.

        The host waits, on every path: on a GPU the barrier's kernel runs on the stream, and its
        end is waited for on the host (as torch.distributed's barrier does on NCCL), not only
        ordered before the caller's next kernels. With ``async_op=True``, ``wait()`` does that.
        """
        fn = "barrier"
        self._check_usable(fn)
        work = self._run(fn, None, True, lambda p: p.barrier(), blocking=True)
        if async_op:
            return work
        work.wait()
        return None

    def monitored_barrier(self, timeout: float | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not arrive within ``timeout`` seconds
        (default: the communicator's) in a :class:`CommTimeoutError`; on gloo, as torch's is."""
        fn = "monitored_barrier"
        self._check_usable(fn)
        seconds = self.timeout if timeout is None else timeout
        try:
            self._fallback.monitored_barrier(seconds, wait_all_ranks)
        except RuntimeError as err:
            text = str(err)
            # gloo on rank 0: "[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 2000 ms";
            # the other ranks hear only that rank 0 failed them.
            found = re.search(r"Ranks? ([\d, ]+) failed to pass", text)
            missing = [int(r) for r in re.findall(r"\d+", found.group(1))] if found else [0]
            raise CommTimeoutError(
                fn, None, self.rank, missing, seconds, detail=f"gloo: {text.splitlines()[0]}"
            ) from err


def _shape_of(size: tuple, fn: str) -> tuple[int, ...]:
    """torch.empty's size arguments (ints, or one sequence of ints) as a tuple of ints."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    for s in size:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"gpucomm.{fn}: size must be non-negative ints, got {size!r}")
    return tuple(size)


def _to_end(serve: Callable[[object], Work], path: object) -> None:
    """Run a call on ``path`` and wait for its end (on the progress thread)."""
    serve(path).wait()


def _operator(op: object, fn: str) -> tuple[ReduceOp, float | None, str]:
    """The operator a path applies, the PREMUL_SUM factor (or None) and the name to log."""
    scale = premul_factor(op, fn)
    if scale is not None:
        return ReduceOp.SUM, scale, "PREMUL_SUM"
    rop = as_reduce_op(op, fn)
    return rop, None, rop.name


def _fingerprint(fn: str, tensor: torch.Tensor | None, fields: dict[str, object]) -> int:
    """What every rank must agree on for the call: the collective, its options (op, root, the
    caller's dtype), the wire dtype and, but for all_to_all, the element count."""
    parts: list[object] = [fn, *sorted(fields.items())]
    if tensor is not None:
        parts.append(tensor.dtype)
        if fn not in _UNEVEN_SIZES:
            parts.append(tensor.numel())
    return zlib.crc32(repr(parts).encode())


def _sent_as(tensor: torch.Tensor, wire: torch.Tensor) -> dict[str, str]:
    """The caller's dtype, for the log and the call's fingerprint, where the wire form differs."""
    if wire.dtype == tensor.dtype:
        return {}
    return {"user_dtype": str(tensor.dtype).removeprefix("torch.")}


class _Planned:
    """The engine with the algorithm of one call fixed: ``p.all_reduce(t, op)`` for either path."""

    def __init__(self, engine: Engine, algo: str) -> None:
        self._engine = engine
        self._algo = algo

    def __getattr__(self, name: str) -> Callable[..., Work]:
        return functools.partial(getattr(self._engine, name), algo=self._algo)
