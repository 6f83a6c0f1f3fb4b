"""The workspace path: gpucomm's own kernels over the symmetric workspace.

The engine owns what one communicator needs on this path: the workspace, the programs of the
calls it has served (one per call shape, built by the algorithms through a
:class:`gpucomm.ops.program.Builder`), the executor that runs them, the mailboxes of send/recv and
the inter-node group of hierarchical collectives.

Layout of one rank's workspace (:mod:`gpucomm.workspace.layout`, which ``python -m gpucomm.env``
reads too)::

    flags: [sync flags: channels x P | p2p "data ready": P | p2p "consumed": P | state |
            device API: bank (slots x P) | device state | identity: 2 x channels x P x 2]
           sync flag c * P + p is channel c's flag written by rank p; state is
           [poison, epoch of channel 0, ..., epoch of channel C-1], written only by the owner;
           the device API (gpucomm.language) has a bank and state of its own, which the
           program kernel never touches (gpucomm/language/layout.py); identity slot
           (parity, c, p): the call's words that rank p stores beside its flag (FlagLayout)
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
    hierarchical,
    p2p,
    select,
)
from gpucomm.capture import capturing
from gpucomm.errors import UnsupportedError, WorkspaceUnavailableError
from gpucomm.language.context import DeviceContext
from gpucomm.ops.contract import Region
from gpucomm.ops.program import Builder, Program, overlaps
from gpucomm.ops.registry import get_kernels
from gpucomm.reduce_op import ReduceOp
from gpucomm.reliability.lost import LostPeers
from gpucomm.roles import Group
from gpucomm.transport import Workspace, open_workspace
from gpucomm.transport.heap import StoreAgreement, SymmetricHeap
from gpucomm.transport.heap_open import agree, heap_kind, heap_of_its_own, vmm_heap
from gpucomm.workspace import node_sizes
from gpucomm.workspace.collectives import EngineCollectives
from gpucomm.workspace.gpu_share import node_channels
from gpucomm.workspace.layout import ALIGN, DataLayout, FlagLayout
from gpucomm.workspace.multimem import SIGNAL_PAD_BYTES, MultimemAllReduce
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
    """Where an engine's ranks agree in the store: under the communicator's prefix, the
    transport's, and the node's where the communicator spans nodes.

    A communicator on a GPU opens two engines at once (CUDA tensors on cuda_ipc, CPU tensors on
    shm); with the transport in the prefix a rank done with one never reads its peers' handles
    of the other as its own."""
    node_tag = f"n{topology.node}/" if topology.hierarchical else ""
    return f"{comm_prefix}{transport}/{node_tag}"


class Engine(EngineCollectives):
    """The workspace path of one communicator (of its node's members when it spans nodes)."""

    def __init__(self, comm: Group, transport: str, kernels: str, device: torch.device, topology: Topology) -> None:
        self.topology = topology
        self.members = topology.nodes[topology.node]  # communicator rank of each local rank
        self.rank = topology.local
        self.world_size = len(self.members)
        self.comm_rank, self.comm_size, self.timeout = comm.rank, comm.world_size, comm.timeout
        self.lost = LostPeers(comm._liveness, self.members, comm.rank, comm.timeout)  # gone peers, told in waits
        self.knob_algo = comm.config.algo
        self.transport = transport
        self.device = device
        self.kernels = get_kernels(kernels, device)
        data_bytes = comm.config.workspace_bytes_for(device.type)
        layout = DataLayout(data_bytes)
        self.p2p_bytes, self.half_bytes = layout.p2p_bytes, layout.half_bytes
        self.stage_half_bytes = layout.stage_half_bytes
        # Direct reduce-scatter and scatter stage one sub-slot per rank in a half: one 16-byte vector at least.
        if self.half_bytes // self.world_size < 16:
            raise UnsupportedError(
                f"gpucomm: GPUCOMM_WORKSPACE_BYTES={data_bytes} leaves halves of {self.half_bytes} bytes, too "
                f"small for 16 bytes per rank of {self.world_size} ranks on a node; raise it"
            )
        store_prefix = engine_store_prefix(comm.prefix, transport, topology)
        self.channels = node_channels(
            comm.config.channels, self.kernels.name, device, comm.store, store_prefix + "gpu/", self.rank,
            self.world_size, comm.timeout,
        )  # fmt: skip
        # GPUCOMM_CHANNELS fixes every launch's grid; otherwise it follows each program's size.
        self.channels_by_size = not comm.config.channels
        self.flags = FlagLayout(self.world_size, self.channels)
        self.mail = p2p.Mailboxes(self, self.flags.p2p_ready, self.flags.p2p_done)  # checks its layout first
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
            # Each rank computes its channels itself, and a byte must belong to the same channel on
            # every rank (gpucomm.workspace.channels): ranks that differ fail here, every one of them.
            agree={"channels": self.channels},
        )
        # The symmetric heap opens at the first call that needs it (open_heap): nothing of it is
        # allocated or agreed here, so that a communicator that never asks for one (most
        # subgroups) costs no heap memory and no store round trip.
        self._store = comm.store
        self.heap_bytes = comm.config.heap_bytes_for(device.type) // ALIGN * ALIGN
        self.heap_prefix = store_prefix + "heap/"
        self.graph_prefix = store_prefix + "graph/"  # captured calls' segments (gpucomm.workspace.graph_buffers)
        self.heap: SymmetricHeap | None = None
        self._heap_workspace: Workspace | None = None  # the heap's own shm / CUDA IPC buffers
        self._heap_tries = 0  # opens that failed: each try agrees under a prefix of its own
        self._programs: collections.OrderedDict[Hashable, Program] = collections.OrderedDict()
        self.caller: str | None = None  # the caller's dtype where it is not the wire's (calling)
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
            self.inter = hierarchical.InterNode(comm, topology, transport) if topology.hierarchical else None
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
        node_sizes.agree(comm, transport, topology.nodes)  # a rank of another layout fails here, on every rank
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
                f"gpucomm[rank {self.comm_rank}]: the symmetric heap is a CUDA IPC allocation "
                f"(cudaIpcGetMemHandle), not virtual-memory mapped: {why}"
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
                        f"gpucomm[rank {self.comm_rank}]: the symmetric heap is a CUDA IPC allocation "
                        f"(cudaIpcGetMemHandle): the driver refused the virtual-memory one: {exc}"
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

    @contextlib.contextmanager
    def calling(self, caller: str | None) -> Iterator[None]:
        """Serve one call whose caller passed ``caller`` (a dtype's name; None: the wire's own):
        it joins the identity of every program the call runs (:meth:`program`)."""
        self.caller = caller
        try:
            yield
        finally:
            self.caller = None

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
            if hasattr(self.executor, "graphs"):
                self.executor.graphs.release()  # the peers' segments captured graphs read
            try:
                if self.heap is not None:
                    if self.heap.kind == "workspace" and self.device.type == "cuda" and self.heap.live_blocks:
                        warnings.warn(
                            f"gpucomm: {self.heap.live_blocks} symmetric tensor(s) of this communicator are still "
                            f"alive on {self.device}; their memory (a CUDA IPC allocation) is freed now: do not use "
                            "them any more",
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
        # The kernels' label where they have one: "cuda (emulated)" for the host-built CUDA C++ kernels.
        return {"algo": algo, "transport": self.transport, "kernels": getattr(self.kernels, "label", self.kernels.name)}

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
        ranks, such as all_to_all's split sizes) only into the cache key. The caller's dtype,
        where it is not the wire's (:meth:`calling`), joins the fields.
        """
        if self.caller is not None:
            fields = (*fields, "caller", self.caller)
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
