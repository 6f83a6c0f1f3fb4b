"""The workspace path: gpucomm's own kernels over the symmetric workspace.

The engine owns what one communicator needs on this path (the workspace, the kernels, the epoch
and round counters, the mailboxes of send/recv, the inter-node group of hierarchical
collectives) and the primitives every algorithm in :mod:`gpucomm.algorithms` is built from.

Layout of one rank's workspace::

    flags: [channel 0: collectives | channel 1: p2p "data ready" | channel 2: p2p "consumed"]
           each channel holds one int64 per peer p (flags[c * P + p]), written only by p
    data:  [p2p mailboxes (a quarter) | half 0 | half 1]

Rounds and epochs (channel 0). Every collective is a sequence of ``sync()`` calls; every rank
makes the same number of them per collective (ranks with nothing to do in a step still call
``sync()`` with empty sets), so the epoch counter advances identically everywhere. A flag
value packs the epoch and the call's fingerprint: ``epoch << FP_BITS | fingerprint``. Waiting
for ``flag >= epoch << FP_BITS`` is the epoch test (flags are monotonic: nothing is ever
reset); a peer whose flag carries *this* epoch must carry my fingerprint too, else the ranks
called different collectives (or sizes, dtypes, ops, roots, algorithms) and
:class:`CommMismatchError` is raised. The first sync of every collective signals every peer,
not only those that wait, and in a rooted collective the root also waits for every peer in it:
two ranks that both believe they are the root (``broadcast(t, src=rank)``) see each other's
fingerprint and raise, where they would otherwise both return without waiting for anyone.

Round k is the interval between sync k-1 and sync k (``self.round`` = syncs done so far).
Data written in round k lives in half k % 2 ("round-k data"); it may be read only in round
k + 1, i.e. after sync k and before the reader's sync k + 1. Each ``sync(sources, readers)``
names whose round-k data this rank reads next (``sources``: it waits for them) and who reads
its own round-k data (``readers``: it signals them). The engine adds a carry-over from the
previous sync: it signals last sync's ``sources`` (I have finished reading your data) and waits
for last sync's ``readers`` (you have finished reading mine). So before a rank writes round
k + 1 data into half (k + 1) % 2, every reader of the round-(k-1) data that half held has
passed sync k after its reads. The argument needs nothing else: it holds for full barriers
(one-shot), neighbour-only steps (ring), parent/child steps (tree), one-sided steps (gather,
scatter) and across collectives of different algorithms, because the carry-over lives in the
engine, not in the algorithm. Signal and wait sets stay symmetric as long as the algorithms'
declarations are (p is in my ``readers`` exactly when I am in p's ``sources``), which each
algorithm module argues for its own steps.

Send/recv (channels 1 and 2) do not touch the epoch: see :mod:`gpucomm.algorithms.p2p`.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gpucomm.algorithms import allgather, allreduce, alltoall, hierarchical, p2p, reducescatter, rooted, select
from gpucomm.errors import CommMismatchError, CommTimeoutError, UnsupportedError
from gpucomm.ops.contract import Region
from gpucomm.ops.registry import get_kernels
from gpucomm.reduce_op import ReduceOp
from gpucomm.transport import open_workspace
from gpucomm.work import Work

if TYPE_CHECKING:
    from gpucomm.communicator import Communicator

__all__ = ["Engine", "FP_BITS", "CHANNELS", "Topology"]

FP_BITS = 20  # low bits of a flag: the call's fingerprint; the rest: the epoch (2^43 steps)
_ALIGN = 256  # every half starts 256-byte aligned: full 16-byte vectors for the kernels
CHANNELS = 3  # flag channels: collectives, p2p data ready, p2p consumed
COLLECTIVE, P2P_READY, P2P_DONE = range(CHANNELS)
_P2P_SHARE = 4  # the mailboxes take 1/_P2P_SHARE of the data area
# While sends or receives are pending, a collective's wait polls in slices this long and moves
# the mailboxes between them, so that a rank blocked in a collective still feeds a peer's recv.
_PROGRESS_SLICE_S = 0.002


class Topology:
    """Which members of a communicator share a node (members are laid out node-major).

    ``nodes`` lists, per node, the communicator ranks on it; ``local`` (this rank's index on its
    node) and ``node`` place this rank. ``uniform`` is False when nodes hold different numbers
    of members: the workspace path then serves nothing.
    """

    def __init__(self, comm: Communicator) -> None:
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


class Engine:
    """The workspace path of one communicator (of its node's members when it spans nodes)."""

    def __init__(self, comm: Communicator, transport: str, device: torch.device, topology: Topology) -> None:
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
        self.kernels = get_kernels(comm.config.kernels, device)
        data_bytes = comm.config.workspace_bytes
        self.p2p_bytes = data_bytes // _P2P_SHARE // _ALIGN * _ALIGN
        self.half_bytes = (data_bytes - self.p2p_bytes) // 2 // _ALIGN * _ALIGN
        # Direct reduce-scatter and scatter stage one sub-slot per rank in a half: 16 bytes
        # each at least (two fp64 elements, one 16-byte vector).
        if self.half_bytes // self.world_size < 16:
            raise UnsupportedError(
                f"gpucomm: GPUCOMM_WORKSPACE_BYTES={data_bytes} leaves halves of {self.half_bytes} bytes, too "
                f"small for 16 bytes per rank of {self.world_size} ranks on a node; raise it"
            )
        self.mail = p2p.Mailboxes(self, P2P_READY, P2P_DONE)  # checks its layout before anything is opened
        node_tag = f"n{topology.node}/" if topology.hierarchical else ""
        self.workspace = open_workspace(
            transport,
            store=comm.store,
            prefix=comm.prefix + "ws/" + node_tag,
            rank=self.rank,
            world_size=self.world_size,
            data_bytes=self.p2p_bytes + 2 * self.half_bytes,
            flag_count=CHANNELS * self.world_size,
            device=device,
            timeout=comm.timeout,
        )
        self.epoch = 0
        self.round = 0  # syncs done: data written now is round `round` data
        self.fingerprint = 0
        self.op_name = ""  # the collective being served, for error messages
        self._first = False  # the next sync is its collective's first
        self._root: int | None = None  # the root of the current collective, if it has one
        self._carry_sources: list[int] = []
        self._carry_readers: list[int] = []
        try:
            self.inter = hierarchical.InterNode(comm, topology) if topology.hierarchical else None
        except BaseException:
            self.workspace.close()
            raise

    @classmethod
    def create(cls, comm: Communicator) -> Engine | None:
        """The engine the knobs ask for, or None where the fallback serves everything."""
        transport = comm.config.transport
        if transport == "auto":
            if comm.device is None:
                return None
            transport = "cuda_ipc"
        device = torch.device("cpu") if transport == "shm" else comm.device
        if device is None:
            raise UnsupportedError(f"gpucomm: GPUCOMM_TRANSPORT={transport} needs a CUDA device, and this host has none")
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
        return cls(comm, transport, device, topology)

    def close(self) -> None:
        try:
            if self.inter is not None:
                self.inter.close()
        finally:
            self.workspace.close()

    # -- planning -----------------------------------------------------------------------------
    def serves(self, fn: str, tensor: torch.Tensor | None) -> str | None:
        """The algorithm this path runs ``fn`` with, or None if the fallback must serve it."""
        if tensor is not None and tensor.device.type != self.device.type:
            return None
        nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        topology = "hierarchical" if self.topology.hierarchical else self.transport
        return select.choose(fn, nbytes, self.comm_size, topology, self.knob_algo)

    def describe(self, algo: str) -> dict[str, object]:
        return {"algo": algo, "transport": self.transport, "kernels": self.kernels.name}

    # -- primitives the algorithms use --------------------------------------------------------
    def begin(self, op_name: str, fingerprint_fields: Sequence[object], root: int | None = None) -> None:
        """Start one collective: name it for errors and derive its fingerprint (``root``, a
        local rank, is part of it)."""
        self.op_name = op_name
        text = "|".join(str(f) for f in (op_name, *fingerprint_fields, root))
        self.fingerprint = zlib.crc32(text.encode()) & ((1 << FP_BITS) - 1)
        self._first = True
        self._root = root

    def sync(self, sources: Sequence[int] = (), readers: Sequence[int] = ()) -> None:
        """End the current round: signal ``readers`` (they read my data of this round) and wait
        for ``sources`` (I read theirs next), plus the carry-over of the last sync (module
        docstring). Ranks are local ranks."""
        me = self.rank
        sources = [p for p in sources if p != me]
        readers = [p for p in readers if p != me]
        others = [p for p in range(self.world_size) if p != me]
        wait_for = sorted(set(sources) | set(self._carry_readers))
        if self._first:
            signal_to = others
            if self._root == me:
                wait_for = others
            self._first = False
        else:
            signal_to = sorted(set(readers) | set(self._carry_sources))
        self._carry_sources, self._carry_readers = sources, readers
        self.epoch += 1
        self.round += 1
        ws = self.workspace
        if signal_to:
            self.kernels.signal([ws.flag(p, COLLECTIVE * self.world_size + me) for p in signal_to], self.epoch << FP_BITS | self.fingerprint)
        if wait_for:
            flags = [ws.flag(me, COLLECTIVE * self.world_size + p) for p in wait_for]
            self.wait(flags, self.epoch << FP_BITS, wait_for, self.epoch)
            self._check_fingerprints(wait_for, flags)

    def barrier_all(self) -> None:
        """A sync with every local rank in both directions."""
        everyone = self.peers()
        self.sync(everyone, everyone)

    def wait(self, flags: Sequence[Region], target: int, peers: Sequence[int], epoch: int | None, deadline: float | None = None) -> None:
        """Wait until every flag is ``>= target`` or raise :class:`CommTimeoutError` naming the
        peers (local ranks) still missing; moves pending sends and receives meanwhile."""
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        flags, peers = list(flags), list(peers)
        while True:
            busy = self.mail.busy()
            until = min(deadline, time.monotonic() + _PROGRESS_SLICE_S) if busy else deadline
            missing = self.kernels.wait(flags, target, until)
            if not missing:
                return
            flags, peers = [flags[i] for i in missing], [peers[i] for i in missing]
            if time.monotonic() >= deadline:
                raise CommTimeoutError(self.op_name, epoch, self.comm_rank, [self.members[p] for p in peers], self.timeout)
            if busy:
                self.mail.progress()

    def _check_fingerprints(self, peers: Sequence[int], flags: Sequence[Region]) -> None:
        if self.device.type == "cpu":
            seen = [int(f.view(torch.int64)[0]) for f in flags]
        else:
            seen = torch.stack([f.view(torch.int64)[0] for f in flags]).tolist()
        for peer, value in zip(peers, seen):
            if value >> FP_BITS == self.epoch and value & ((1 << FP_BITS) - 1) != self.fingerprint:
                raise CommMismatchError(
                    f"gpucomm.{self.op_name} epoch {self.epoch}: rank {self.comm_rank} and rank {self.members[peer]} "
                    f"called different collectives (or sizes, dtypes, ops, roots or algorithms) at the same step"
                )

    def write_offset(self) -> int:
        """Byte offset (in the data area) of the half that data written now goes to."""
        return self.p2p_bytes + (self.round % 2) * self.half_bytes

    def read_offset(self) -> int:
        """Byte offset of the half holding the data of the last round, readable now."""
        return self.p2p_bytes + ((self.round - 1) % 2) * self.half_bytes

    def slot(self, peer: int, offset: int, nbytes: int) -> Region:
        """``nbytes`` bytes of local rank ``peer``'s data area from ``offset``."""
        return self.workspace.data(peer, offset, nbytes)

    def peers(self) -> list[int]:
        return list(range(self.world_size))

    def local_of(self, comm_rank: int) -> int:
        """The local rank of a communicator rank on this node (flat: the same rank)."""
        return self.members.index(comm_rank)

    # -- collectives (the same arguments as GlooFallback's methods, plus the algorithm) ---------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, algo: str) -> Work:
        self.begin("all_reduce", (tensor.dtype, tensor.numel(), op.name, algo))
        if algo == "hierarchical":
            hierarchical.all_reduce(self, tensor, op)
        else:
            allreduce.run(algo, self, tensor, op)
        return self.completed()

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, algo: str) -> Work:
        root = self.local_of(dst)
        self.begin("reduce", (tensor.dtype, tensor.numel(), op.name, algo), root)
        rooted.reduce(algo, self, tensor, root, op)
        return self.completed()

    def broadcast(self, tensor: torch.Tensor, src: int, *, algo: str) -> Work:
        root = self.local_of(src)
        self.begin("broadcast", (tensor.dtype, tensor.numel(), algo), root)
        rooted.broadcast(algo, self, tensor, root)
        return self.completed()

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, *, algo: str) -> Work:
        self.begin("all_gather", (tensor.dtype, tensor.numel(), algo))
        allgather.run(algo, self, Region.of(tensor), [Region.of(t) for t in outputs])
        return self.completed()

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, *, algo: str) -> Work:
        self.begin("all_gather_into_tensor", (tensor.dtype, tensor.numel(), algo))
        whole, size = Region.of(output), tensor.numel() * tensor.element_size()
        allgather.run(algo, self, Region.of(tensor), [whole.sub(p * size, size) for p in self.peers()])
        return self.completed()

    def gather(self, tensor: torch.Tensor, outputs: Sequence[torch.Tensor] | None, dst: int, *, algo: str) -> Work:
        root = self.local_of(dst)
        self.begin("gather", (tensor.dtype, tensor.numel(), algo), root)
        rooted.gather(self, tensor, outputs, root)
        return self.completed()

    def scatter(self, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int, *, algo: str) -> Work:
        root = self.local_of(src)
        self.begin("scatter", (tensor.dtype, tensor.numel(), algo), root)
        rooted.scatter(self, tensor, inputs, root)
        return self.completed()

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: ReduceOp, *, algo: str) -> Work:
        self.begin("reduce_scatter", (output.dtype, output.numel(), op.name, algo))
        reducescatter.run(algo, self, [Region.of(t) for t in inputs], Region.of(output), output.dtype, op)
        return self.completed()

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, algo: str) -> Work:
        self.begin("reduce_scatter_tensor", (output.dtype, output.numel(), op.name, algo))
        whole, size = Region.of(input), output.numel() * output.element_size()
        chunks = [whole.sub(p * size, size) for p in self.peers()]
        reducescatter.run(algo, self, chunks, Region.of(output), output.dtype, op, source=whole)
        return self.completed()

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *, algo: str) -> Work:
        self.begin("all_to_all", (inputs[0].dtype, algo))
        alltoall.run(self, [Region.of(t) for t in outputs], [Region.of(t) for t in inputs])
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
        self.begin("all_to_all_single", (input.dtype, tuple(input.shape[1:]), algo))
        P = self.world_size
        outs = _split(output, output_split_sizes, P)
        ins = _split(input, input_split_sizes, P)
        alltoall.run(self, outs, ins)
        return self.completed()

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, algo: str) -> Work:
        return self.mail.isend(Region.of(tensor), self.local_of(dst), tag)

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int, *, algo: str) -> Work:
        return self.mail.irecv(Region.of(tensor), None if src is None else self.local_of(src), tag)

    def barrier(self, *, algo: str) -> Work:
        self.begin("barrier", ())
        self.barrier_all()
        return self.completed()

    def completed(self) -> Work:
        """The Work of a collective whose kernels were all issued on the current stream."""
        if self.device.type != "cuda":
            return Work()
        event = torch.cuda.Event()
        event.record()
        return Work(event=event)


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
