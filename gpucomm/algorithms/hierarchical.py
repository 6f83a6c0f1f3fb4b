"""Collectives across nodes: the workspace inside each node, torch.distributed between nodes.

Ranks are laid out node-major (node = rank // local_world_size, the layout torchrun gives);
``GPUCOMM_LOCAL_WORLD_SIZE`` smaller than the world pretends to have several nodes on one
machine. The engine's workspace then spans only its node's ranks, and:

- all_reduce = intra-node reduce-scatter on the workspace (rank l of the node gets shard l of
  the tensor, summed over the node) + inter-node all-reduce of that shard through
  torch.distributed among the ranks with the same local rank (NCCL for CUDA tensors where torch
  has it, gloo otherwise; groups built here on gpucomm's store, never torch's default group) +
  intra-node all-gather of the shards on the workspace. Each rank moves 2·(L-1)/L·n bytes
  inside its node and n/L across nodes. The inter-node stage runs in the accumulation type
  (fp32 for 16-bit floats) and AVG divides once, at its end, by the world size; 16-bit floats
  are therefore rounded twice (after the node's reduce-scatter and at the end).
- every other collective goes through torch.distributed directly (the communicator's gloo
  group): the selector returns no workspace algorithm for them (gpucomm.algorithms.select).
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from gpucomm.algorithms import allgather, reducescatter, select
from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp, accumulation_dtype

if TYPE_CHECKING:
    from gpucomm.communicator import Communicator
    from gpucomm.engine import Engine, Topology

__all__ = ["InterNode", "all_reduce"]

_TORCH_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,  # then one division by the world size
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


class InterNode:
    """The torch.distributed group of the ranks that share this rank's local rank, one per node."""

    def __init__(self, comm: Communicator, topology: Topology) -> None:
        self.rank = topology.node
        self.size = len(topology.nodes)
        self.world_size = comm.world_size
        self.timeout = datetime.timedelta(seconds=comm.timeout)
        self._store = dist.PrefixStore(f"{comm.prefix}inter/{topology.local}/", comm.store)
        # gloo connects every pair at construction, which every member does now (the engine
        # is built collectively); NCCL is built on first use by a CUDA tensor, which is also
        # collective (every member calls the same all_reduce).
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", self._store), self.rank, self.size, self.timeout)
        self._nccl: dist.ProcessGroup | None = None

    def _group(self, tensor: torch.Tensor) -> dist.ProcessGroup:
        if tensor.device.type != "cuda" or not dist.is_nccl_available():
            return self._gloo
        if self._nccl is None:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", self._store), self.rank, self.size, options)
        return self._nccl

    def all_reduce(self, shard: torch.Tensor, op: ReduceOp) -> None:
        """All-reduce ``shard`` in place across nodes; AVG divides by the whole world size."""
        acc = accumulation_dtype(shard.dtype)
        buffer = shard if shard.dtype == acc else shard.to(acc)
        options = dist.AllreduceOptions()
        options.reduceOp = _TORCH_OP[op]
        self._group(buffer).allreduce([buffer], options).wait()
        if op is ReduceOp.AVG:
            if buffer.is_floating_point():
                buffer = torch.div(buffer, torch.full_like(buffer, self.world_size))
            else:
                buffer = torch.div(buffer, self.world_size, rounding_mode="trunc")
        if buffer is not shard:
            shard.copy_(buffer)

    def close(self) -> None:
        """Stop the groups' threads and release them now (see GlooFallback.close). Idempotent."""
        groups, self._nccl, self._gloo = (self._nccl, self._gloo), None, None
        for group in groups:
            shutdown = getattr(group, "shutdown", None)
            if shutdown is not None:
                shutdown()


def all_reduce(engine: Engine, tensor: torch.Tensor, op: ReduceOp) -> None:
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
        intra_op = ReduceOp.SUM if op is ReduceOp.AVG else op
        fields = (tensor.dtype, n, op.name, "hierarchical", "node reduce-scatter", rs)
        scatter = lambda b: reducescatter.run(rs, b, shards, shards[me], tensor.dtype, intra_op, source=whole)  # noqa: E731
        engine.run("all_reduce", fields, [whole], scatter)
    if bounds[me + 1] > bounds[me]:  # the same on every member of the inter-node group
        engine.inter.all_reduce(tensor.view(-1)[bounds[me] : bounds[me + 1]], op)
    if L > 1:
        fields = (tensor.dtype, n, "hierarchical", "node all-gather", ag)
        engine.run("all_reduce", fields, [whole], lambda b: allgather.run(ag, b, shards[me], shards))
