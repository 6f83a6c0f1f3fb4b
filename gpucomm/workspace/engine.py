"""The workspace path: gpucomm's own kernels over the symmetric workspace.

The engine owns what one communicator needs on this path: the workspace, the programs of the
calls it has served (one per call shape, built by the algorithms through a
:class:`gpucomm.ops.program.Builder`), the executor that runs them, the mailboxes of send/recv and
the inter-node group of hierarchical collectives.

Layout of one rank's workspace (:mod:`gpucomm.workspace.layout`, which ``python -m gpucomm.env``
reads too)::

    flags: [sync flags: channels x P | p2p "data ready": P | p2p "consumed": P | state |
            device API: bank (slots x P) | device state]
           sync flag c * P + p is channel c's flag written by rank p; state is
           [poison, epoch of channel 0, ..., epoch of channel C-1], written only by the owner;
           the device API (gpucomm.language) has a bank and state of its own, which the
           program kernel never touches (gpucomm/language/layout.py)
    data:  [p2p mailboxes (a quarter) | half 0 | half 1 | device stage: 2 x half / 2]

The symmetric heap (:mod:`gpucomm.transport.heap`, GPUCOMM_HEAP_BYTES) holds the tensors of
``gpucomm.empty``: a collective on one of them reads the peers' copies where they are, with no
copy into the halves (``allreduce.twoshot_symmetric``, :mod:`gpucomm.algorithms.symmetric`,
:mod:`gpucomm.workspace.multimem`). It is not part of the workspace: it opens, collectively, at the first
call that needs it (:meth:`Engine.open_heap`: ``gpucomm.empty``, ``mem_pool``, ``heap()``), as
memory of its own (gpucomm.transport.heap_open): the driver's virtual-memory API on a GPU that
has it, else a shared-memory segment (CPU) or CUDA IPC allocation of its own. A communicator
that never asks for it allocates and agrees nothing about it.
The device stage is the device API's (``gpucomm.language.stage``): kernels written with it
stage their data there, never where a program's peers may still read.

Executors: the program kernel (Triton, or CUDA C++) runs a program in one launch with the
epochs on the device and every wait inside the kernel (:mod:`gpucomm.workspace.device_executor`); the
torch reference kernels run it step by step from the host (:mod:`gpucomm.workspace.host_executor`).
Either way a program means the same thing (:mod:`gpucomm.ops.program`).

Send/recv do not touch the epochs: see :mod:`gpucomm.algorithms.p2p`.
"""

from __future__ import annotations

import collections
import contextlib
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence

import torch

from gpucomm import log
from gpucomm.algorithms import (
    allgather,
    allreduce,
    alltoall,
    hierarchical,
    p2p,
    reducescatter,
    rooted,
    select,
    symmetric,
)
from gpucomm.capture import capturing
from gpucomm.errors import UnsupportedError, WorkspaceUnavailableError
from gpucomm.language import layout as device_layout
from gpucomm.language.context import DeviceContext
from gpucomm.ops.contract import Region
from gpucomm.ops.device_guard import launching_on
from gpucomm.ops.program import Builder, Program, overlaps
from gpucomm.ops.registry import get_kernels
from gpucomm.reduce_op import ReduceOp
from gpucomm.roles import Group
from gpucomm.transport import Workspace, open_workspace
from gpucomm.transport.heap import StoreAgreement, SymmetricHeap
from gpucomm.transport.heap_open import agree, heap_kind, heap_of_its_own, vmm_heap
from gpucomm.work import Work
from gpucomm.workspace.channels import launch_channels, layout_channels
from gpucomm.workspace.layout import ALIGN, DataLayout, FlagLayout
from gpucomm.workspace.multimem import SIGNAL_PAD_BYTES, MultimemAllReduce, exact_in_any_order
from gpucomm.workspace.small import SmallAllReduce
from gpucomm.workspace.stream_order import StreamOrder

__all__ = ["Engine", "Topology", "FlagLayout"]

# Programs kept per communicator, one per call shape (the buffers' addresses are not part of
# it: executors bind a program to the addresses of a call). A training loop calls a few shapes.
_PROGRAM_CACHE = 256


class Topology:
    """Which members of a communicator share a node (members are laid out node-major).

    ``nodes`` lists, per node, the communicator ranks on it; ``local`` (this rank's index on its
    node) and ``node`` place this rank. ``uniform`` is False when nodes hold different numbers
    of members: the workspace path then serves nothing.
    """

    def __init__(self, comm: Group) -> None:
        per_node = max(1, comm.local_world_size)
        by_node: dict[int, list[int]] = {}
        for member, global_rank in enumerate(comm.global_ranks):
            by_node.setdefault(global_rank // per_node, []).append(member)
        self.nodes = [by_node[k] for k in sorted(by_node)]
        self.uniform = len({len(members) for members in self.nodes}) == 1
        self.node = next(i for i, members in enumerate(self.nodes) if comm.rank in members)
        self.local = self.nodes[self.node].index(comm.rank)

    @property
    def hierarchical(self) -> bool:
        return len(self.nodes) > 1


def engine_store_prefix(comm_prefix: str, transport: str, topology: Topology) -> str:
    """Where an engine's ranks agree in the store: a communicator on a GPU opens two engines at
    once (CUDA tensors on cuda_ipc, CPU tensors on shm), and a rank done with one must not read
    its peers' handles of the other (seen on an H100, 2026-11-25, before the transport was part of
    the prefix: rank 1 read rank 0's CUDA IPC handle as a shm one)."""
    node_tag = f"n{topology.node}/" if topology.hierarchical else ""
    return f"{comm_prefix}{transport}/{node_tag}"


class Engine:
    """The workspace path of one communicator (of its node's members when it spans nodes)."""

    def __init__(self, comm: Group, transport: str, kernels: str, device: torch.device, topology: Topology) -> None:
        self.topology = topology
        self.members = topology.nodes[topology.node]  # communicator rank of each local rank
        self.rank = topology.local
        self.world_size = len(self.members)
        self.comm_rank = comm.rank
        self.comm_size = comm.world_size
        self.timeout = comm.timeout
        self.knob_algo = comm.config.algo
        self.transport = transport
        self.device = device
        self.kernels = get_kernels(kernels, device)
        data_bytes = comm.config.workspace_bytes_for(device.type)
        layout = DataLayout(data_bytes)
        self.p2p_bytes, self.half_bytes, self.stage_half_bytes = (
            layout.p2p_bytes,
            layout.half_bytes,
            layout.stage_half_bytes,
        )
        # Direct reduce-scatter and scatter stage one sub-slot per rank in a half: 16 bytes
        # each at least (two fp64 elements, one 16-byte vector).
        if self.half_bytes // self.world_size < 16:
            raise UnsupportedError(
                f"gpucomm: GPUCOMM_WORKSPACE_BYTES={data_bytes} leaves halves of {self.half_bytes} bytes, too "
                f"small for 16 bytes per rank of {self.world_size} ranks on a node; raise it"
            )
        self.channels = layout_channels(comm.config.channels, self.kernels.name, device, self.world_size)
        # GPUCOMM_CHANNELS fixes every launch's grid; otherwise it follows each program's size.
        self.channels_by_size = not comm.config.channels
        self.flags = FlagLayout(self.world_size, self.channels)
        self.mail = p2p.Mailboxes(self, self.flags.p2p_ready, self.flags.p2p_done)  # checks its layout first
        store_prefix = engine_store_prefix(comm.prefix, transport, topology)
        self.workspace = open_workspace(
            transport,
            store=comm.store,
            prefix=store_prefix + "ws/",
            rank=self.rank,
            world_size=self.world_size,
            data_bytes=layout.data_bytes,
            flag_count=self.flags.count,
            device=device,
            timeout=comm.timeout,
        )
        # The symmetric heap opens at the first call that needs it (open_heap): nothing of it is
        # allocated or agreed here, so that a communicator that never asks for one (most
        # subgroups) costs no heap memory and no store round trip.
        self._store = comm.store
        self.heap_bytes = comm.config.heap_bytes_for(device.type) // ALIGN * ALIGN
        self.heap_prefix = store_prefix + "heap/"
        self.heap: SymmetricHeap | None = None
        self._heap_workspace: Workspace | None = None  # the heap's own shm / CUDA IPC buffers
        self._heap_tries = 0  # opens that failed: each try agrees under a prefix of its own
        self._programs: collections.OrderedDict[Hashable, Program] = collections.OrderedDict()
        self._device_context: DeviceContext | None = None  # gpucomm.language's, built on first use
        # On a GPU a blocking call launches on the caller's current stream; an asynchronous one
        # on a stream of this communicator's own, after the caller's (as ProcessGroupNCCL's);
        # ``order`` keeps the programs in call order across those streams. Futures complete on a
        # side stream that waits for one collective's end and nothing after it.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.order = StreamOrder.on(device, self.stream) if self.stream is not None else None
        # Until the heap opens no tensor is symmetric, so the multimem path serves nothing; its
        # reason says now what does not depend on the heap, and the multicast one once it opens.
        self.multimem = MultimemAllReduce(None, 0, self._multimem_reason(""), self.channels, self.timeout)
        try:
            self.executor = self._make_executor()
            self.small = SmallAllReduce(self)
            self.inter = hierarchical.InterNode(comm, topology) if topology.hierarchical else None
        except BaseException:
            self.workspace.close()
            raise

    @classmethod
    def create(cls, comm: Group, transport: str, kernels: str) -> Engine | None:
        """The engine of ``transport`` ("shm" or "cuda_ipc") with ``kernels``, or None where no
        workspace layout serves this communicator (then gloo serves its tensors)."""
        device = torch.device("cpu") if transport == "shm" else comm.device
        if device is None:
            raise UnsupportedError(
                f"gpucomm: GPUCOMM_TRANSPORT={transport} needs a CUDA device, and this host has none"
            )
        topology = Topology(comm)
        if not topology.uniform:
            # Nodes with different member counts: no layout serves them; gloo does, unless a
            # transport was asked for by name.
            if comm.config.transport != "auto":
                raise UnsupportedError(
                    f"gpucomm: GPUCOMM_TRANSPORT={transport} needs the same number of ranks on every node, got "
                    f"{[len(m) for m in topology.nodes]} (local_world_size={comm.local_world_size})"
                )
            return None
        return cls(comm, transport, kernels, device, topology)

    def open_heap(self, fn: str) -> SymmetricHeap | None:
        """The node's symmetric heap, opened by the first call that needs it (None where
        GPUCOMM_HEAP_BYTES=0). Collective: every local rank calls it, as they call ``fn``.

        Where it comes from (gpucomm.transport.heap_open): on a GPU, the driver's virtual-memory
        API where every local rank has it, with its multicast object where every GPU takes one;
        else (and on the CPU) a shared-memory segment or CUDA IPC allocation of its own.

        Raises:
            WorkspaceUnavailableError: the host has no room for it (a /dev/shm too small, no
                device memory), on every rank together; the communicator goes on working, and
                the next call that needs the heap tries again.
        """
        if self.heap is not None or not self.heap_bytes:
            return self.heap
        prefix = f"{self.heap_prefix}open{self._heap_tries}/"
        self._heap_tries += 1
        agreed = lambda mine: agree(self._store, prefix + "kind/", self.rank, self.world_size, self.timeout, mine)  # noqa: E731
        kind, why = heap_kind(self.device, agreed)
        if why and self.rank == 0:  # one line per node, when the heap opens
            log.logger.warning(
                f"gpucomm[rank {self.comm_rank}]: the symmetric heap is a CUDA IPC allocation (cudaIpcGetMemHandle), not "
                f"virtual-memory mapped: {why}"
            )
        agree_alloc = StoreAgreement(self._store, self.heap_prefix, self.rank, self.world_size, self.timeout)
        if kind == "vmm":
            from gpucomm.transport.vmm import VmmHeapRefused

            try:
                heap, mc_base, mc_reason = vmm_heap(
                    self._store,
                    prefix,
                    self.rank,
                    self.world_size,
                    self.device,
                    self.heap_bytes,
                    agree_alloc,
                    SIGNAL_PAD_BYTES,
                    self.timeout,
                )
            except VmmHeapRefused as exc:  # raised by every local rank at the same step
                kind = "workspace"
                if self.rank == 0:
                    log.logger.warning(
                        f"gpucomm[rank {self.comm_rank}]: the symmetric heap is a CUDA IPC allocation (cudaIpcGetMemHandle): "
                        f"the driver refused the virtual-memory one: {exc}"
                    )
        if kind != "vmm":
            try:
                heap, self._heap_workspace = heap_of_its_own(
                    self.transport,
                    self._store,
                    prefix,
                    self.rank,
                    self.world_size,
                    self.device,
                    self.heap_bytes,
                    agree_alloc,
                    SIGNAL_PAD_BYTES,
                    self.timeout,
                )
            except WorkspaceUnavailableError as exc:  # raised by every local rank at the same step
                raise WorkspaceUnavailableError(
                    exc.transport,
                    exc.reasons,
                    f"{exc.advice}. gpucomm.{fn} needs the symmetric heap ({self.heap_bytes} bytes per rank, "
                    f"GPUCOMM_HEAP_BYTES); this communicator's other calls go on working without it".lstrip(". "),
                ) from exc
            mc_base = 0
            mc_reason = (
                "the heap is a CUDA IPC allocation, which no multicast object can bind"
                if self.device.type == "cuda"
                else ""
            )
        self.heap = heap
        self.multimem = MultimemAllReduce(heap, mc_base, self._multimem_reason(mc_reason), self.channels, self.timeout)
        if self.multimem.reason and self.device.type == "cuda" and self.rank == 0:  # one line per node
            log.logger.warning(
                f"gpucomm[rank {self.comm_rank}]: no multimem (NVLink SHARP) all_reduce here: {self.multimem.reason}"
            )
        if self._device_context is not None:
            self._device_context.add_region(heap)  # kernels of the context reach the heap from now on
        return heap

    def _multimem_reason(self, mc_reason: str) -> str:
        """Why the multimem path (gpucomm.workspace.multimem) is unavailable here ("" where it is):
        ``mc_reason`` (the heap's multicast object), else what the kernels and the device say."""
        if not self.heap_bytes:
            return "no symmetric heap (GPUCOMM_HEAP_BYTES=0)"
        if mc_reason:
            return mc_reason
        if self.kernels.name != "triton":
            return f"the multimem kernel is Triton's, and this engine runs kernels={self.kernels.name}"
        if self.device.type == "cpu":
            from gpucomm._kernels.triton.clock import INTERPRETED

            return "" if INTERPRETED else "on the CPU only the Triton interpreter runs the multicast view"
        return ""

    def _make_executor(self) -> object:
        if self.kernels.name == "torch":
            from gpucomm.workspace.host_executor import HostExecutor

            return HostExecutor(self)
        from gpucomm.workspace.device_executor import DeviceExecutor

        return DeviceExecutor(self)

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """Run what is inside on this engine's stream, after the caller's current stream's work
        and after this communicator's launches so far (:mod:`gpucomm.workspace.stream_order`)."""
        if self.stream is None:
            yield
            return
        self.order.to_engine()
        with torch.cuda.stream(self.stream):
            yield

    def on_caller_stream(self) -> None:
        """Before launches on the caller's current stream: order it after this communicator's
        launches so far (nothing while it captures a CUDA graph)."""
        if self.order is not None:
            self.order.to_caller()

    def upload(self, table: torch.Tensor) -> torch.Tensor:
        """``table`` (host memory) copied to this engine's device without waiting for the device.

        On a GPU the copy is made on the engine's stream, after this communicator's launches so
        far, and the caller's current stream then waits for it. A table is launched from several
        streams over its life (blocking calls on the caller's, asynchronous ones on the engine's)
        and freed when its program or binding is dropped; the caching allocator hands its memory
        out again only to allocations on the stream it was allocated on, the engine's, and those
        are gpucomm's own, each made after every launch so far: never while a kernel reads it.
        """
        if self.stream is None:
            return table.to(self.device)
        pinned = table.pin_memory()  # a copy from pinned memory does not block the host
        with self.on_stream():
            copy = pinned.to(self.device, non_blocking=True)
        self.order.to_caller()
        return copy

    def device_context(self, fn: str = "device_context") -> DeviceContext:
        """The context of kernels written with :mod:`gpucomm.language` on this workspace."""
        if self._device_context is None:
            if self.topology.hierarchical:
                raise UnsupportedError(
                    f"gpucomm.{fn}: the device API serves the ranks of one node; this communicator's span nodes"
                )
            # The heap is a region of its own; one that opens later is added then (open_heap).
            self._device_context = DeviceContext(self, self._agree_max, [] if self.heap is None else [self.heap])
        return self._device_context

    def _agree_max(self, value: int) -> int:
        """The largest ``value`` of every rank: a one-shot all_reduce (MAX) on this workspace."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.all_reduce(t, ReduceOp.MAX, algo="oneshot")
        return int(t[0])

    def close(self) -> None:
        self._device_context = None
        try:
            if self.inter is not None:
                self.inter.close()
        finally:
            self._programs.clear()
            try:
                if self.heap is not None:
                    if self.heap.kind == "workspace" and self.device.type == "cuda" and self.heap.live_blocks:
                        warnings.warn(
                            f"gpucomm: {self.heap.live_blocks} symmetric tensor(s) of this communicator are still alive on "
                            f"{self.device}; their memory (a CUDA IPC allocation) is freed now: do not use them any more",
                            RuntimeWarning,
                            stacklevel=3,
                        )
                    self.heap.close()
                if self._heap_workspace is not None:
                    self._heap_workspace.close()  # collective on a GPU, as the workspace's close
            finally:
                self.workspace.close()

    # -- planning -----------------------------------------------------------------------------
    def serves(self, fn: str, tensor: torch.Tensor | None) -> str | None:
        """The algorithm this path runs ``fn`` with, or None if the fallback must serve it."""
        if tensor is not None and tensor.device.type != self.device.type:
            return None
        nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        topology = "hierarchical" if self.topology.hierarchical else self.transport
        algo = select.choose(fn, nbytes, self.comm_size, topology, self.knob_algo)
        if select.forced_algo(fn, self.knob_algo) != "auto":
            return algo
        if algo == select.SMALL and self.small.unsupported(tensor):
            algo = "oneshot"  # the same algorithm through the program kernel (named, it raises why not)
        if algo == "oneshot" and nbytes > self.half_bytes and self.symmetric_offset(tensor) is not None:
            # Where the model has one-shot ahead of two-shot through the halves (2 and 3 ranks on
            # a GPU), a symmetric tensor larger than a half still goes in place: two-shot reads
            # the peers' copies with no copy in and three SYNCs in all, one-shot through the
            # halves copies every piece in and SYNCs once a piece (bench/model.py's symmetric rows).
            return "twoshot"
        return algo

    def describe(self, algo: str) -> dict[str, object]:
        return {"algo": algo, "transport": self.transport, "kernels": self.kernels.name}

    # -- programs -----------------------------------------------------------------------------
    def program(
        self,
        name: str,
        fields: tuple,
        regions: Sequence[Region],
        build: Callable[[Builder], None],
        root: int | None = None,
        local: tuple = (),
    ) -> Program:
        """The program of this call shape: built by ``build`` on first use, then reused.

        ``fields`` (what every rank must agree on: dtype, count, op, algorithm, ...) go into the
        fingerprint; ``regions`` (this rank's buffers) and ``local`` (what may differ between
        ranks, such as all_to_all's split sizes) only into the cache key.
        """
        key = (name, fields, root, local, tuple(r.nbytes for r in regions), overlaps(regions))
        program = self._programs.get(key)
        if program is None:
            heap = None if self.heap is None else self.heap.base_addrs
            builder = Builder(self.rank, self.world_size, self.half_bytes, name, fields, root, args=regions, heap=heap)
            build(builder)
            program = builder.finish()
            self._programs[key] = program
            if len(self._programs) > _PROGRAM_CACHE:
                self._evict()
        else:
            self._programs.move_to_end(key)
        if capturing(self.device):
            program.captured = True  # a graph launches its tables: they stay as long as the engine
        return program

    def _evict(self) -> None:
        """Drop the least recently used program that no CUDA graph captured."""
        for key, program in self._programs.items():
            if not program.captured:
                del self._programs[key]
                return

    def run(
        self,
        name: str,
        fields: tuple,
        regions: Sequence[Region],
        build: Callable[[Builder], None],
        root: int | None = None,
        local: tuple = (),
    ) -> None:
        """Run the program of this call shape (arguments as :meth:`program`) on these buffers."""
        self.executor.run(self.program(name, fields, regions, build, root, local), tuple(r.addr for r in regions))

    def mailbox(self, peer: int, offset: int, nbytes: int) -> Region:
        """``nbytes`` bytes of local rank ``peer``'s send/recv area from ``offset``."""
        return self.workspace.data(peer, offset, nbytes)

    def published(self, offset: int, nbytes: int) -> list[torch.Tensor]:
        """Every rank's bytes at ``offset`` of the half holding the data written before the last
        sync, as uint8 views; waits once for the executor's work so far to finish."""
        start = self.p2p_bytes + (self.executor.epoch() - 1) % 2 * self.half_bytes + offset
        return [self.workspace.data(p, start, nbytes).bytes for p in range(self.world_size)]

    def local_of(self, comm_rank: int) -> int:
        """The local rank of a communicator rank on this node (flat: the same rank)."""
        return self.members.index(comm_rank)

    # -- collectives (the same arguments as GlooFallback's methods, plus the algorithm) ---------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, algo: str) -> Work:
        if algo == "hierarchical":
            hierarchical.all_reduce(self, tensor, op)
        elif algo == "oneshot_lang":
            self._all_reduce_lang(tensor, op)
        elif algo == select.SMALL:
            self.small.run(tensor, op)
        elif algo == "multimem" or self._multimem_by_default(tensor, op, algo):
            self.multimem.run(tensor, op)
        else:
            fields, build = self._all_reduce_plan(tensor, op, algo)
            self.run("all_reduce", fields, [Region.of(tensor)], build)
        return self.completed()

    def _all_reduce_lang(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """The one-shot all_reduce written with gpucomm.language (kernels/triton/oneshot.py): the
        program kernel's one-shot, bit for bit, as one launch of a kernel of the device API."""
        self._lang_launch(tensor, op, ordered=False)()

    def _lang_launch(self, tensor: torch.Tensor, op: ReduceOp, ordered: bool) -> Callable[[], None]:
        """The launch of :meth:`_all_reduce_lang` on ``tensor``'s buffer, its checks around it;
        ``ordered``: first order the caller's stream after this communicator's launches (the
        repeated call's path, :mod:`gpucomm.workspace.repeat`; the full path's caller does it)."""
        if self.kernels.name != "triton":
            raise UnsupportedError(
                f"gpucomm.all_reduce: GPUCOMM_ALGO=oneshot_lang runs a Triton kernel; GPUCOMM_KERNELS={self.kernels.name} runs none"
            )
        from gpucomm._kernels.triton import oneshot

        ctx = self.device_context("all_reduce")
        # The grid follows the size as the program kernel's does (gpucomm.workspace.channels), within the
        # channel slots of the device API.
        nbytes = min(tensor.numel() * tensor.element_size(), ctx.stage_half_bytes)
        channels = launch_channels(nbytes, min(self.channels, device_layout.CHANNEL_SLOTS))
        # Triton's JIT launches on the current device: this engine's, whatever the caller's is.
        launch = launching_on(
            self.device,
            oneshot.prepare(ctx, tensor.data_ptr(), tensor.numel(), tensor.dtype, int(op), self.world_size, channels),
        )
        check, on_cpu = ctx.check, self.stream is None
        to_caller = self.order.to_caller if ordered and self.order is not None else None

        def run() -> None:
            check("all_reduce")
            if to_caller is not None:
                to_caller()
            launch()
            if on_cpu:
                check("all_reduce")  # the launch has run: its errors are there now

        return run

    def _multimem_by_default(self, tensor: torch.Tensor, op: ReduceOp, algo: str) -> bool:
        """``auto`` takes the multimem path on a GPU for a symmetric tensor whose fold is exact
        in any order (integer SUM, MIN, MAX), above one-shot's sizes (the model's crossover:
        docs/performance.md), where the switch is there."""
        return (
            self.device.type == "cuda"
            and algo == "twoshot"
            and select.forced_algo("all_reduce", self.knob_algo) == "auto"
            and exact_in_any_order(tensor.dtype, op)
            and not self.multimem.unsupported(tensor, op)
        )

    def symmetric_offset(self, tensor: torch.Tensor) -> int | None:
        """The heap offset of ``tensor`` if it lies in the symmetric heap, else None."""
        heap = self.heap
        return heap.offset(tensor) if heap is not None and heap.contains(tensor) else None

    def _all_reduce_plan(
        self, tensor: torch.Tensor, op: ReduceOp, algo: str
    ) -> tuple[tuple, Callable[[Builder], None]]:
        """The fields and the build of an all_reduce: in place on a symmetric tensor where the
        algorithm has a form that reads the peers' copies (two-shot), else through the halves.
        The heap offset is part of the fields, so that ranks that pass tensors at different
        offsets (or a symmetric tensor against an ordinary one) raise CommMismatchError."""
        offset = self.symmetric_offset(tensor) if algo == "twoshot" else None
        # In place only where it saves SYNCs: a tensor that fits one half moves in one piece
        # with two SYNCs through the halves, against three in place (docs/performance.md:
        # 8 x H100, 64 MiB workspace, in place ahead from 32 MiB, behind at 8 MiB); forced
        # two-shot (GPUCOMM_ALGO) runs in place at any size.
        nbytes = tensor.numel() * tensor.element_size()
        if (
            offset is not None
            and nbytes <= self.half_bytes
            and select.forced_algo("all_reduce", self.knob_algo) != "twoshot"
        ):
            offset = None
        if offset is None:
            return (tensor.dtype, tensor.numel(), op.name, algo), lambda b: allreduce.run(algo, b, tensor, op)
        fields = (tensor.dtype, tensor.numel(), op.name, algo, "symmetric", offset)
        return fields, lambda b: allreduce.twoshot_symmetric(b, tensor, op)

    def repeat_all_reduce(self, tensor: torch.Tensor, op: ReduceOp, algo: str) -> Callable[[], None]:
        """The launch of :meth:`all_reduce` of this shape on ``tensor``'s buffer (which has run
        once), for :mod:`gpucomm.workspace.repeat`: the program and the buffer's address, no tensor."""
        if algo == "oneshot_lang":
            return self._lang_launch(tensor, op, ordered=True)
        if algo == select.SMALL:
            return self.small.repeat(tensor, op)
        if algo == "multimem" or self._multimem_by_default(tensor, op, algo):
            launch = self.multimem.bind(tensor, op)
            if self.stream is None:
                return launch
            on_caller = self.on_caller_stream

            def launch_on_caller() -> None:
                on_caller()
                launch()

            return launch_on_caller
        fields, build = self._all_reduce_plan(tensor, op, algo)
        region = Region.of(tensor)
        program = self.program("all_reduce", fields, [region], build)
        addrs = (region.addr,)
        repeat = getattr(self.executor, "repeat", None)  # the device executor's launch, looked up once
        if repeat is not None:
            return repeat(program, addrs)
        run = self.executor.run
        return lambda: run(program, addrs)

    def _in_place(self, algo: str, nbytes: int, *tensors: torch.Tensor) -> tuple[int, ...] | None:
        """The heap offsets of ``tensors`` (the ones the peers read) where a direct collective
        moving ``nbytes`` runs in place (gpucomm.algorithms.symmetric): all of them symmetric,
        and more bytes than one half (below, one piece through the halves takes one sync, the
        in-place program two)."""
        if algo != "direct" or nbytes <= self.half_bytes:
            return None
        offsets = tuple(self.symmetric_offset(t) for t in tensors)
        return None if None in offsets else offsets

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, algo: str) -> Work:
        root = self.local_of(dst)
        fields = (tensor.dtype, tensor.numel(), op.name, algo)
        build = lambda b: rooted.reduce(algo, b, tensor, root, op)  # noqa: E731
        offsets = self._in_place(algo, tensor.numel() * tensor.element_size(), tensor)
        if offsets is not None:
            fields, build = (*fields, "symmetric", offsets), lambda b: symmetric.reduce(b, tensor, root, op)  # noqa: E731
        self.run("reduce", fields, [Region.of(tensor)], build, root)
        return self.completed()

    def broadcast(self, tensor: torch.Tensor, src: int, *, algo: str) -> Work:
        root = self.local_of(src)
        fields = (tensor.dtype, tensor.numel(), algo)
        build = lambda b: rooted.broadcast(algo, b, tensor, root)  # noqa: E731
        offsets = self._in_place(algo, tensor.numel() * tensor.element_size(), tensor)
        if offsets is not None:
            fields, build = (*fields, "symmetric", offsets), lambda b: symmetric.broadcast(b, tensor, root)  # noqa: E731
        self.run("broadcast", fields, [Region.of(tensor)], build, root)
        return self.completed()

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, *, algo: str) -> Work:
        mine, outs = Region.of(tensor), [Region.of(t) for t in outputs]
        self.run(
            "all_gather",
            (tensor.dtype, tensor.numel(), algo),
            [mine, *outs],
            lambda b: allgather.run(algo, b, mine, outs),
        )
        return self.completed()

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, *, algo: str) -> Work:
        mine, whole, size = Region.of(tensor), Region.of(output), tensor.numel() * tensor.element_size()
        outs = [whole.sub(p * size, size) for p in range(self.world_size)]
        fields = (tensor.dtype, tensor.numel(), algo)
        build = lambda b: allgather.run(algo, b, mine, outs)  # noqa: E731
        # In place where the input is symmetric (the peers read it); the output may be any tensor.
        offsets = self._in_place(algo, whole.nbytes, tensor)
        if offsets is not None:
            fields, build = (
                (*fields, "symmetric", offsets),
                lambda b: symmetric.all_gather_into_tensor(b, whole, tensor),
            )  # noqa: E731
        self.run("all_gather_into_tensor", fields, [mine, whole], build)
        return self.completed()

    def gather(self, tensor: torch.Tensor, outputs: Sequence[torch.Tensor] | None, dst: int, *, algo: str) -> Work:
        root = self.local_of(dst)
        regions = [Region.of(tensor), *(Region.of(t) for t in outputs or ())]
        fields = (tensor.dtype, tensor.numel(), algo)
        self.run("gather", fields, regions, lambda b: rooted.gather(b, tensor, outputs, root), root)
        return self.completed()

    def scatter(self, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int, *, algo: str) -> Work:
        root = self.local_of(src)
        regions = [Region.of(tensor), *(Region.of(t) for t in inputs or ())]
        fields = (tensor.dtype, tensor.numel(), algo)
        self.run("scatter", fields, regions, lambda b: rooted.scatter(b, tensor, inputs, root), root)
        return self.completed()

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: ReduceOp, *, algo: str) -> Work:
        chunks, out = [Region.of(t) for t in inputs], Region.of(output)
        fields = (output.dtype, output.numel(), op.name, algo)
        self.run(
            "reduce_scatter",
            fields,
            [*chunks, out],
            lambda b: reducescatter.run(algo, b, chunks, out, output.dtype, op),
        )
        return self.completed()

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, algo: str) -> Work:
        whole, out, size = Region.of(input), Region.of(output), output.numel() * output.element_size()
        chunks = [whole.sub(p * size, size) for p in range(self.world_size)]
        fields = (output.dtype, output.numel(), op.name, algo)
        build = lambda b: reducescatter.run(algo, b, chunks, out, output.dtype, op, source=whole)  # noqa: E731
        # In place where the input is symmetric (the peers read it); the output may be any tensor.
        offsets = self._in_place(algo, whole.nbytes, input)
        if offsets is not None:
            fields, build = (
                (*fields, "symmetric", offsets),
                lambda b: symmetric.reduce_scatter_tensor(b, out, whole, output.dtype, op),
            )  # noqa: E731
        self.run("reduce_scatter_tensor", fields, [whole, out], build)
        return self.completed()

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *, algo: str) -> Work:
        self._all_to_all(
            "all_to_all", (inputs[0].dtype, algo), [Region.of(t) for t in outputs], [Region.of(t) for t in inputs]
        )
        return self.completed()

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None,
        *,
        algo: str,
    ) -> Work:
        P = self.world_size
        fields = (input.dtype, tuple(input.shape[1:]), algo)
        self._all_to_all(
            "all_to_all_single", fields, _split(output, output_split_sizes, P), _split(input, input_split_sizes, P)
        )
        return self.completed()

    def _all_to_all(self, name: str, fields: tuple, outs: list[Region], ins: list[Region]) -> None:
        """The two programs of :mod:`gpucomm.algorithms.alltoall` and the host's look at the headers."""
        sizes = tuple(r.nbytes for r in ins + outs)
        regions = [*outs, *ins]
        announce = lambda b: alltoall.announce(
            b, outs, ins, b.keep(self.upload(alltoall.size_table(outs, ins, torch.device("cpu"))))
        )  # noqa: E731
        first = self.program(name, (*fields, "announce"), regions, announce, local=sizes)
        self.executor.run(first, tuple(r.addr for r in regions))
        P = self.world_size
        matrix = torch.stack(self.published(0, 16 * P)).view(torch.int64).tolist()  # one read of all headers
        total = alltoall.rounds(matrix, self.half_bytes, self.members, name)
        self.run(
            name, (*fields, "deliver", total), regions, lambda b: alltoall.deliver(b, outs, ins, total), local=sizes
        )

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, algo: str) -> Work:
        return self.mail.isend(Region.of(tensor), self.local_of(dst), tag)

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int, *, algo: str) -> Work:
        return self.mail.irecv(Region.of(tensor), None if src is None else self.local_of(src), tag)

    def barrier(self, *, algo: str) -> Work:
        self.run("barrier", (), [], lambda b: b.barrier_all())
        return self.completed()

    def completed(self) -> Work:
        """The Work of a collective whose kernels were all issued (the communicator adds the
        end of its stream on a GPU)."""
        return Work()


def _split(tensor: torch.Tensor, splits: Sequence[int] | None, parts: int) -> list[Region]:
    """The regions of ``tensor``'s dim-0 splits (equal splits when ``splits`` is empty)."""
    rows = tensor.shape[0] if tensor.dim() else 0
    sizes = list(splits) if splits else [rows // parts] * parts
    row_bytes = tensor[0].numel() * tensor.element_size() if rows else 0
    whole, regions, offset = Region.of(tensor), [], 0
    for rows_p in sizes:
        regions.append(whole.sub(offset, rows_p * row_bytes))
        offset += rows_p * row_bytes
    return regions
