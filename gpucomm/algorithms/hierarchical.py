"""Collectives across nodes: the workspace inside each node, torch.distributed between nodes.

Ranks are laid out node-major (node = rank // local_world_size, the layout torchrun gives);
``GPUCOMM_LOCAL_WORLD_SIZE`` smaller than the world pretends to have several nodes on one
machine. The engine's workspace then spans only its node's ranks, and:

- all_reduce, in three stages:

  1. intra-node reduce-scatter on the workspace: rank l of the node gets shard l of the tensor,
     folded over the node's ranks in rank order;
  2. inter-node all-gather of that shard through torch.distributed among the ranks with the
     same local rank, folded locally in node order (NCCL for CUDA tensors where torch has it,
     gloo otherwise; groups built here on gpucomm's store, never torch's default group);
  3. intra-node all-gather of the shards on the workspace.

  Each rank moves 2·(L-1)/L·n bytes inside its node and receives (N-1)/L·n bytes across N nodes
  (the same as a ring all-reduce's 2(N-1)/N/L·n at N = 2, N/2 times more beyond).
- every other collective but send and recv in stages of the same kind, composed in
  :mod:`gpucomm.algorithms.across_nodes` (with this module's inter-node group); send and recv
  go through the communicator's gloo group.

Deterministic by contract, in a fixed two-level order: every stage runs in the accumulation
type (16-bit floats are staged in fp32, on a buffer kept for the next call of that size, and so
move twice their bytes inside the node), so an element's result is
``round((x[node 0] ⊕ x[node 1] ⊕ ...) / W)``, where ``x[node k]`` is the fold of node k's ranks
in rank order, the nodes are folded in node order, AVG divides once by the world size W at the
end and the one rounding to the dtype comes last. It depends on the layout (ranks per node),
never on the size, the algorithm of the node's stages (save a forced ring, which warns) or the
nodes' arrival order.

Why not torch.distributed's all-reduce across nodes: gloo's ring (and NCCL's ring or tree) folds
each chunk starting at another rank, so the bits of an element would depend on where it falls in
the message.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gpucomm import log
from gpucomm.algorithms import allgather, reducescatter, select
from gpucomm.errors import CommTimeoutError
from gpucomm.ops.contract import Region
from gpucomm.ops.program import Builder
from gpucomm.ops.reference import fold_into
from gpucomm.reduce_op import ReduceOp, accumulation_dtype
from gpucomm.roles import Group

__all__ = ["InterNode", "Placement", "NodeEngine", "all_reduce", "log_stage", "make_nccl", "takes_nccl"]


@runtime_checkable
class Placement(Protocol):
    """Where this rank sits among the nodes (:class:`gpucomm.workspace.engine.Topology`)."""

    node: int  # this rank's node
    local: int  # this rank's index on its node

    @property
    def nodes(self) -> Sequence[Sequence[int]]:
        """The communicator ranks on each node."""
        ...


def takes_nccl(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` crosses nodes on NCCL: a CUDA tensor, where torch has NCCL."""
    return tensor.device.type == "cuda" and dist.is_nccl_available()


def make_nccl(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    """The NCCL group of the ranks with one local rank, on gpucomm's store (built on first use)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as one uint8 row: the nodes move bytes, whatever the dtype
    (gloo and NCCL both move uint8; some dtypes gpucomm serves, such as float8, they do not)."""
    return tensor.reshape(-1).view(torch.uint8)


def _connect_failed(comm: Group, topology: Placement, err: BaseException) -> CommTimeoutError:
    """The error of an inter-node group that could not connect: the group (this rank's local
    index on every node) in group and global numbering, each other member waited for (gloo does
    not say which peer it waited for)."""
    members = [node[topology.local] for node in topology.nodes if topology.local < len(node)]
    reason = str(err).splitlines()[0] if str(err) else ""
    return CommTimeoutError(
        "init (the inter-node gloo group)",
        None,
        topology.node,
        [n for n in range(len(members)) if n != topology.node],
        comm.timeout,
        detail=f"connecting the inter-node gloo group failed ({type(err).__name__}: {reason})",
        global_ranks=[comm.global_ranks[m] for m in members] if len(members) == len(topology.nodes) else None,
    )


class InterNode:
    """The torch.distributed group of the ranks that share this rank's local rank, one per node."""

    def __init__(self, comm: Group, topology: Placement, tag: str = "") -> None:
        self.rank = topology.node
        self.size = len(topology.nodes)
        self.world_size = comm.world_size
        self.timeout = datetime.timedelta(seconds=comm.timeout)
        # ``tag`` (the engine's transport) keeps apart the groups of a communicator's two engines
        # on a GPU host (CUDA tensors, CPU tensors), which connect at the same time.
        self._store = dist.PrefixStore(f"{comm.prefix}inter/{tag}{topology.local}/", comm.store)
        # gloo connects every pair at construction, which every member does now (the engine
        # is built collectively); NCCL is built on first use by a CUDA tensor, which is also
        # collective (every member calls the same all_reduce).
        try:
            self._gloo = dist.ProcessGroupGloo(
                dist.PrefixStore("gloo/", self._store), self.rank, self.size, self.timeout
            )
        except dist.DistError as err:  # gloo's raw DistStoreError (a timeout) or DistNetworkError
            raise _connect_failed(comm, topology, err) from err
        self._nccl: dist.ProcessGroup | None = None
        # The accumulation-type copy of the last 16-bit tensor reduced, reused while the size
        # stays the same: the node's programs are cached by address (gpucomm.workspace.engine).
        self._staging: torch.Tensor | None = None

    def _group(self, tensor: torch.Tensor) -> dist.ProcessGroup:
        if not takes_nccl(tensor):
            return self._gloo
        if self._nccl is None:
            self._nccl = make_nccl(dist.PrefixStore("nccl/", self._store), self.rank, self.size, self.timeout)
        return self._nccl

    def path(self, tensor: torch.Tensor | None) -> str:
        """The engine that carries ``tensor`` between nodes: "nccl" or "gloo" (for the log)."""
        return "nccl" if tensor is not None and takes_nccl(tensor) else "gloo"

    # -- the data movements of the other collectives (gpucomm.algorithms.across_nodes) ----------
    # Each is one torch.distributed collective of this group; ``root`` is a node index.
    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> None:
        """``output`` (size x tensor's bytes, contiguous) gets every node's ``tensor`` in node order."""
        self._group(tensor)._allgather_base(_flat(output), _flat(tensor)).wait()

    def all_to_all(
        self, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int], in_splits: list[int]
    ) -> None:
        """Node k gets ``tensor``'s piece k (``in_splits``); ``output`` holds the pieces from every node."""
        group = self._group(tensor)
        group.alltoall_base(_flat(output), _flat(tensor), out_splits, in_splits, dist.AllToAllOptions()).wait()

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root
        self._group(tensor).broadcast([_flat(tensor)], options).wait()

    def gather(self, output: torch.Tensor | None, tensor: torch.Tensor, root: int) -> None:
        """Node ``root``'s ``output`` (size x tensor's bytes) gets every node's ``tensor`` in node order."""
        options = dist.GatherOptions()
        options.rootRank = root
        outputs = [list(_flat(output).tensor_split(self.size))] if self.rank == root else []
        self._group(tensor).gather(outputs, [_flat(tensor)], options).wait()

    def scatter(self, output: torch.Tensor, tensor: torch.Tensor | None, root: int) -> None:
        """Node k's ``output`` gets piece k of node ``root``'s ``tensor`` (size x output's bytes)."""
        options = dist.ScatterOptions()
        options.rootRank = root
        inputs = [list(_flat(tensor).tensor_split(self.size))] if self.rank == root else []
        self._group(output).scatter([_flat(output)], inputs, options).wait()

    def barrier(self) -> None:
        """Return once every node's member of this group has arrived (gloo: there is no tensor)."""
        self._gloo.barrier(dist.BarrierOptions()).wait()

    def staging(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor``'s values in its accumulation type (exact), in a buffer kept for reuse."""
        acc = accumulation_dtype(tensor.dtype)
        buffer = self._staging
        if buffer is None or buffer.numel() != tensor.numel() or buffer.dtype != acc or buffer.device != tensor.device:
            buffer = self._staging = torch.empty(tensor.numel(), dtype=acc, device=tensor.device)
        buffer.copy_(tensor.view(-1))
        return buffer

    def all_reduce(self, shard: torch.Tensor, op: ReduceOp) -> None:
        """Reduce ``shard`` (in its accumulation type) in place across nodes, in node order.

        AVG divides once by the whole world size.
        """
        gathered = [torch.empty_like(shard) for _ in range(self.size)]
        self._group(shard).allgather([gathered], [shard]).wait()
        fold_into(shard, gathered, op, self.world_size, None)

    def close(self) -> None:
        """Stop the groups' threads and release them now (see GlooFallback.close). Idempotent."""
        groups, self._nccl, self._gloo = (self._nccl, self._gloo), None, None
        for group in groups:
            shutdown = getattr(group, "shutdown", None)
            if shutdown is not None:
                shutdown()


@runtime_checkable
class NodeEngine(Protocol):
    """What the hierarchical all_reduce drives (:class:`gpucomm.workspace.engine.Engine`).

    The node's flat algorithms on its workspace, and the inter-node group.
    """

    rank: int  # this rank's index on the node
    world_size: int  # ranks on the node
    transport: str
    knob_algo: str  # GPUCOMM_ALGO, which the node's stages follow too
    inter: InterNode | None  # None where the communicator spans one node
    comm_rank: int  # this rank in the communicator (for the log)
    topology: Placement

    def describe(self, algo: str) -> dict[str, object]: ...

    def run(self, name: str, fields: tuple, regions: Sequence[Region], build: Callable[[Builder], None]) -> None: ...


def log_stage(
    engine: NodeEngine,
    fn: str,
    step: int,
    steps: int,
    tensor: torch.Tensor | None,
    algo: str | None,
    via: str | None = None,
) -> None:
    """One GPUCOMM_DEBUG=INFO line per stage: its path in the node (``algo``, the flat collective
    ``via`` where it is not ``fn``) or between nodes (None)."""
    if not log.logger.isEnabledFor(logging.INFO):
        return
    if algo is not None:
        where = {"where": "in node", **({"via": via} if via and via != fn else {}), "path": "workspace"}
        where.update(engine.describe(algo))
    else:
        group = [node[engine.topology.local] for node in engine.topology.nodes]
        where = {"where": "between nodes", "path": engine.inter.path(tensor), "group": group}
    text = log.describe_call(engine.comm_rank, f"{fn} stage {step}/{steps}", tensor, **where)
    log.logger.info(text.replace("where=", "").replace("via=", "via "))


def all_reduce(engine: NodeEngine, tensor: torch.Tensor, op: ReduceOp) -> None:
    if accumulation_dtype(tensor.dtype) != tensor.dtype:
        staged = engine.inter.staging(tensor)
        _all_reduce(engine, staged, op)
        tensor.view(-1).copy_(staged)  # the one rounding, to nearest even
    else:
        _all_reduce(engine, tensor, op)


def _all_reduce(engine: NodeEngine, tensor: torch.Tensor, op: ReduceOp) -> None:
    L, me = engine.world_size, engine.rank
    n, size = tensor.numel(), tensor.element_size()
    whole = Region.of(tensor)
    bounds = [n * i // L for i in range(L + 1)]
    shards = [whole.sub(bounds[i] * size, (bounds[i + 1] - bounds[i]) * size) for i in range(L)]
    nbytes = n * size
    # The node's stages follow the flat table for a world of L ranks (GPUCOMM_ALGO=ring or
    # direct applies to them too).
    rs = select.choose("reduce_scatter_tensor", nbytes // max(L, 1), L, engine.transport, engine.knob_algo)
    ag = select.choose("all_gather_into_tensor", nbytes // max(L, 1), L, engine.transport, engine.knob_algo)
    if L > 1:
        log_stage(engine, "all_reduce", 1, 3, tensor, rs)
        intra_op = ReduceOp.SUM if op is ReduceOp.AVG else op
        fields = (tensor.dtype, n, op.name, "hierarchical", "node reduce-scatter", rs)
        scatter = lambda b: reducescatter.run(rs, b, shards, shards[me], tensor.dtype, intra_op, source=whole)  # noqa: E731
        engine.run("all_reduce", fields, [whole], scatter)
    if bounds[me + 1] > bounds[me]:  # the same on every member of the inter-node group
        shard = tensor.view(-1)[bounds[me] : bounds[me + 1]]
        log_stage(engine, "all_reduce", 2 if L > 1 else 1, 3 if L > 1 else 1, shard, None)
        engine.inter.all_reduce(shard, op)
    if L > 1:
        log_stage(engine, "all_reduce", 3, 3, tensor, ag)
        fields = (tensor.dtype, n, "hierarchical", "node all-gather", ag)
        engine.run("all_reduce", fields, [whole], lambda b: allgather.run(ag, b, shards[me], shards))
