"""Every collective but all_reduce across nodes: the node's workspace inside, torch.distributed between.

Where a communicator spans N nodes of L ranks (:class:`gpucomm.workspace.engine.Topology`), each
collective is composed of the node's flat collectives on its workspace (the algorithm the flat
table picks for L ranks) and one collective of an inter-node group
(:class:`gpucomm.algorithms.hierarchical.InterNode`: the N ranks that share a local rank, NCCL
for CUDA tensors where torch has it, gloo otherwise, built on gpucomm's store). ``(k, l)`` is
local rank l of node k; ``n`` the bytes of one rank's piece; W = N·L.

- all_gather: between nodes, an all-gather of each rank's piece in its local group (each rank
  gets (k, l) for every k: (N-1)·n in); then in the node, an all-gather of those N pieces;
  the pieces are put in rank order.
- reduce_scatter: in the node, a reduce-scatter of the input regrouped so that local rank l
  gets the node's fold of the N pieces destined to (k, l); between nodes, an all-to-all of
  those folds in the local group ((N-1)·n out), folded in node order on arrival.
- broadcast: between nodes, from the root in the root's local group; then from that local
  rank in every node.
- reduce: in the node, a reduce to the root's local rank; between nodes, a gather of the
  nodes' folds to the root, folded there in node order.
- gather: in the node, a gather to the root's local rank (L·n); between nodes, a gather of
  those blocks to the root.
- scatter: between nodes, a scatter of the root's blocks of L·n to the root's local rank on
  every node; then a scatter in every node from it.
- all_to_all: the node's input sizes first (an all-gather of W counts in the node); in the
  node, an all-to-all that hands local rank m every piece destined to (k, m) for any k;
  between nodes, an all-to-all in the local group: each byte crosses nodes once.
- barrier: in the node; between nodes, local rank 0 of each node; in the node again.

Bytes crossing nodes, summed over all ranks: all_gather and reduce_scatter (W-L)·N·n against a
node-major flat ring's (W-1)·N·n; broadcast and reduce (N-1)·n, the ring's; gather, scatter
and all_to_all what a direct send of every off-node piece moves (a ring forwards more). The
reductions travel in the accumulation type (16-bit floats as fp32: twice their bytes), which
keeps the one rounding of the contract.

Results: the data movements are bitwise those of one node (they copy bytes). The reductions
fold in the two-level order of the hierarchical all_reduce: each node's ranks in rank order,
then the nodes in node order, in the accumulation type, AVG dividing once by W, one rounding to
the dtype at the end (docs/algorithms.md, "Deterministic reductions").

With ``GPUCOMM_DEBUG=INFO`` every stage logs one line: ``stage i/s``, where it runs ("in node"
or "between nodes") and its path (the workspace algorithm, or nccl / gloo and the group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from gpucomm.algorithms import select
from gpucomm.algorithms.hierarchical import InterNode, Placement, log_stage
from gpucomm.ops.reference import fold_into
from gpucomm.reduce_op import ReduceOp, accumulation_dtype

__all__ = [
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "SpanningEngine",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
]


@runtime_checkable
class SpanningEngine(Protocol):
    """What the compositions drive: the workspace engine of a communicator whose ranks span
    nodes (:class:`gpucomm.workspace.engine.Engine`): the node's flat collectives (each with the
    arguments of :class:`gpucomm.comm.path.Path`'s and ``algo=``), and the inter-node group."""

    rank: int  # this rank's index on its node
    world_size: int  # ranks on the node
    members: list[int]  # the communicator rank of each local rank
    comm_rank: int
    comm_size: int
    transport: str
    knob_algo: str  # GPUCOMM_ALGO, which the node's stages follow
    device: torch.device
    topology: Placement
    inter: InterNode | None

    describe: Callable[[str], dict[str, object]]
    all_gather_into_tensor: Callable[..., object]
    reduce_scatter_tensor: Callable[..., object]
    broadcast: Callable[..., object]
    reduce: Callable[..., object]
    gather: Callable[..., object]
    scatter: Callable[..., object]
    all_to_all: Callable[..., object]
    barrier: Callable[..., object]


# -- helpers ----------------------------------------------------------------------------------
def _nodes(engine: SpanningEngine) -> list[list[int]]:
    return [list(node) for node in engine.topology.nodes]


def _place(engine: SpanningEngine, comm_rank: int) -> tuple[int, int]:
    """(node, local rank) of a communicator rank."""
    for k, node in enumerate(engine.topology.nodes):
        if comm_rank in node:
            return k, list(node).index(comm_rank)
    raise ValueError(f"gpucomm: rank {comm_rank} is on none of the nodes {engine.topology.nodes}")


def _flat_algo(engine: SpanningEngine, fn: str, nbytes: int) -> str:
    """The node stage's algorithm: the flat table's for L ranks (GPUCOMM_ALGO applies too)."""
    return select.choose(fn, nbytes, engine.world_size, engine.transport, engine.knob_algo)


def _node(
    engine: SpanningEngine, fn: str, step: int, steps: int, tensor: torch.Tensor | None, nbytes: int, via: str = ""
) -> str:
    """The node stage's algorithm for the flat collective ``via`` (``fn`` itself by default), logged."""
    algo = _flat_algo(engine, via or fn, nbytes)
    log_stage(engine, fn, step, steps, tensor, algo, via)
    return algo


def _between(engine: SpanningEngine, fn: str, step: int, steps: int, tensor: torch.Tensor | None) -> None:
    log_stage(engine, fn, step, steps, tensor, None)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def _order(engine: SpanningEngine) -> list[int]:
    """The communicator rank of row l·N + k of a node's staging: (k, l), local rank major."""
    nodes = _nodes(engine)
    return [nodes[k][l] for l in range(engine.world_size) for k in range(len(nodes))]  # noqa: E741


# -- all_gather -------------------------------------------------------------------------------
def _gather_all(engine: SpanningEngine, fn: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """Every rank's piece, (W, bytes) rows in the order of :func:`_order`; None where empty."""
    n = tensor.numel()
    if n == 0:
        return None
    N, L = len(engine.topology.nodes), engine.world_size
    flat = tensor.reshape(-1)
    gathered = flat.new_empty(N * n)
    _between(engine, fn, 1, 2 if L > 1 else 1, tensor)
    engine.inter.all_gather(gathered, flat)
    if L == 1:
        return _bytes(gathered).view(N, -1)
    staged = flat.new_empty(L * N * n)
    algo = _node(engine, fn, 2, 2, gathered, staged.numel() * staged.element_size(), "all_gather_into_tensor")
    engine.all_gather_into_tensor(staged, gathered, algo=algo)
    return _bytes(staged).view(L * N, -1)


def all_gather_into_tensor(engine: SpanningEngine, output: torch.Tensor, tensor: torch.Tensor) -> None:
    rows = _gather_all(engine, "all_gather_into_tensor", tensor)
    if rows is not None:
        index = torch.tensor(_order(engine), device=rows.device)
        _bytes(output).view(rows.shape[0], -1).index_copy_(0, index, rows)


def all_gather(engine: SpanningEngine, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> None:
    rows = _gather_all(engine, "all_gather", tensor)
    if rows is not None:
        for row, rank in zip(rows, _order(engine)):
            _bytes(outputs[rank]).copy_(row)


# -- reduce_scatter ---------------------------------------------------------------------------
def _reduce_scatter(
    engine: SpanningEngine, fn: str, output: torch.Tensor, pieces: Sequence[torch.Tensor], op: ReduceOp
) -> None:
    """``output`` = the fold of ``pieces[rank]`` of every rank, in the two-level order."""
    n = output.numel()
    if n == 0:
        return
    N, L = len(engine.topology.nodes), engine.world_size
    acc = accumulation_dtype(output.dtype)
    # Row l·N + k: the piece destined to (k, l), in the accumulation type (exact).
    staged = torch.empty(L * N, n, dtype=acc, device=output.device)
    for row, rank in zip(staged, _order(engine)):
        row.copy_(pieces[rank].reshape(-1))
    part = staged.view(-1)
    if L > 1:
        part = staged.new_empty(N * n)
        algo = _node(engine, fn, 1, 2, part, part.numel() * part.element_size(), "reduce_scatter_tensor")
        engine.reduce_scatter_tensor(part, staged.view(-1), ReduceOp.SUM if op is ReduceOp.AVG else op, algo=algo)
    received = part.new_empty(N * n)
    _between(engine, fn, 2 if L > 1 else 1, 2 if L > 1 else 1, part)
    splits = [n * part.element_size()] * N
    engine.inter.all_to_all(received, part, splits, splits)
    _fold(output, list(received.view(N, n)), op, engine.comm_size)


def _fold(output: torch.Tensor, parts: list[torch.Tensor], op: ReduceOp, world_size: int) -> None:
    """``output`` = ``parts`` folded in node order (accumulation type), rounded once."""
    target = output.view(-1)
    if parts[0].dtype == output.dtype:
        fold_into(target, parts, op, world_size, None)
    else:
        total = torch.empty_like(parts[0])
        fold_into(total, parts, op, world_size, None)
        target.copy_(total)  # the one rounding, to nearest even


def reduce_scatter_tensor(engine: SpanningEngine, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
    n = output.numel()
    pieces = list(input.reshape(-1).view(engine.comm_size, n)) if n else []
    _reduce_scatter(engine, "reduce_scatter_tensor", output, pieces, op)


def reduce_scatter(engine: SpanningEngine, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: ReduceOp) -> None:
    _reduce_scatter(engine, "reduce_scatter", output, inputs, op)


# -- rooted collectives -----------------------------------------------------------------------
def broadcast(engine: SpanningEngine, tensor: torch.Tensor, src: int) -> None:
    if tensor.numel() == 0:
        return
    root_node, root_local = _place(engine, src)
    L = engine.world_size
    if engine.rank == root_local:
        _between(engine, "broadcast", 1, 2 if L > 1 else 1, tensor)
        engine.inter.broadcast(tensor, root_node)
    if L > 1:
        algo = _node(engine, "broadcast", 2, 2, tensor, tensor.numel() * tensor.element_size())
        engine.broadcast(tensor, engine.members[root_local], algo=algo)


def reduce(engine: SpanningEngine, tensor: torch.Tensor, dst: int, op: ReduceOp) -> None:
    n = tensor.numel()
    if n == 0:
        return
    root_node, root_local = _place(engine, dst)
    N, L, node = len(engine.topology.nodes), engine.world_size, engine.topology.node
    # A copy in the accumulation type: the node's fold lands on its root's copy, never on a
    # tensor that torch.distributed leaves as it was (every rank but dst).
    part = tensor.reshape(-1).to(accumulation_dtype(tensor.dtype), copy=True)
    if L > 1:
        algo = _node(engine, "reduce", 1, 2, part, part.numel() * part.element_size())
        engine.reduce(part, engine.members[root_local], ReduceOp.SUM if op is ReduceOp.AVG else op, algo=algo)
    if engine.rank != root_local:
        return
    gathered = part.new_empty(N * n) if node == root_node else None
    _between(engine, "reduce", 2 if L > 1 else 1, 2 if L > 1 else 1, part)
    engine.inter.gather(gathered, part, root_node)
    if gathered is not None:
        _fold(tensor, list(gathered.view(N, n)), op, engine.comm_size)


def gather(engine: SpanningEngine, tensor: torch.Tensor, outputs: Sequence[torch.Tensor] | None, dst: int) -> None:
    n = tensor.numel()
    if n == 0:
        return
    root_node, root_local = _place(engine, dst)
    nodes, L = _nodes(engine), engine.world_size
    flat = tensor.reshape(-1)
    block = flat
    if L > 1:
        block = flat.new_empty(L * n) if engine.rank == root_local else None
        algo = _node(engine, "gather", 1, 2, tensor, n * tensor.element_size())
        targets = list(block.view(L, n)) if block is not None else None
        engine.gather(flat, targets, engine.members[root_local], algo=algo)
    if engine.rank != root_local:
        return
    every = flat.new_empty(len(nodes) * L * n) if engine.topology.node == root_node else None
    _between(engine, "gather", 2 if L > 1 else 1, 2 if L > 1 else 1, block)
    engine.inter.gather(every, block, root_node)
    if every is not None:
        rows = every.view(len(nodes), L, n)
        for k, node in enumerate(nodes):
            for l, rank in enumerate(node):  # noqa: E741
                outputs[rank].view(-1).copy_(rows[k, l])


def scatter(engine: SpanningEngine, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int) -> None:
    n = tensor.numel()
    if n == 0:
        return
    root_node, root_local = _place(engine, src)
    nodes, L = _nodes(engine), engine.world_size
    flat = tensor.reshape(-1)
    block = None
    if engine.rank == root_local:
        block = flat if L == 1 else flat.new_empty(L * n)
        every = None
        if engine.topology.node == root_node:
            every = flat.new_empty(len(nodes) * L * n)
            rows = every.view(len(nodes), L, n)
            for k, node in enumerate(nodes):
                for l, rank in enumerate(node):  # noqa: E741
                    rows[k, l].copy_(inputs[rank].reshape(-1))
        _between(engine, "scatter", 1, 2 if L > 1 else 1, tensor)
        engine.inter.scatter(block, every, root_node)
    if L > 1:
        algo = _node(engine, "scatter", 2, 2, tensor, n * tensor.element_size())
        sources = list(block.view(L, n)) if block is not None else None
        engine.scatter(flat, sources, engine.members[root_local], algo=algo)


# -- all_to_all -------------------------------------------------------------------------------
def all_to_all(engine: SpanningEngine, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> None:
    _all_to_all(engine, "all_to_all", [_bytes(t) for t in outputs], [_bytes(t) for t in inputs])


def all_to_all_single(
    engine,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None,
    input_split_sizes: Sequence[int] | None,
) -> None:
    W = engine.comm_size
    _all_to_all(engine, "all_to_all_single", _split(output, output_split_sizes, W), _split(input, input_split_sizes, W))


def _split(tensor: torch.Tensor, splits: Sequence[int] | None, parts: int) -> list[torch.Tensor]:
    """The bytes of ``tensor``'s dim-0 splits (equal splits when ``splits`` is empty)."""
    rows = tensor.shape[0] if tensor.dim() else 0
    sizes = list(splits) if splits else [rows // parts] * parts
    row_bytes = tensor[0].numel() * tensor.element_size() if rows else 0
    return list(_bytes(tensor).split([s * row_bytes for s in sizes]))


def _all_to_all(engine: SpanningEngine, fn: str, outs: list[torch.Tensor], ins: list[torch.Tensor]) -> None:
    """Byte pieces: ``ins[r]`` goes to rank r, ``outs[r]`` comes from rank r."""
    nodes, L, me = _nodes(engine), engine.world_size, engine.rank
    N = len(nodes)
    steps = 3 if L > 1 else 1
    # Every local rank's input sizes: local rank m must know what it receives in the node stage.
    mine = torch.tensor([t.numel() for t in ins], dtype=torch.int64, device=engine.device)
    counts = [mine.tolist()]
    if L > 1:
        every = mine.new_empty(L * len(ins))
        algo = _node(engine, fn, 1, steps, mine, every.numel() * 8, "all_gather_into_tensor")
        engine.all_gather_into_tensor(every, mine, algo=algo)
        counts = every.view(L, -1).tolist()
    # In the node: local rank m gets, from each local rank l, its pieces for (0, m), ..., (N-1, m).
    sends = [torch.cat([ins[nodes[k][m]] for k in range(N)]) for m in range(L)]
    if L > 1:
        received = [ins[0].new_empty(sum(counts[l][nodes[k][me]] for k in range(N))) for l in range(L)]  # noqa: E741
        algo = _node(engine, fn, 2, steps, sends[me], sum(t.numel() for t in sends), "all_to_all")
        engine.all_to_all(received, sends, algo=algo)
    else:
        received = sends
    # Between nodes: node k gets, from every local rank l of this node, its piece for (k, me).
    pieces = [list(r.split([counts[l][nodes[k][me]] for k in range(N)])) for l, r in enumerate(received)]  # noqa: E741
    out_going = torch.cat([pieces[l][k] for k in range(N) for l in range(L)])  # noqa: E741
    in_splits = [sum(pieces[l][k].numel() for l in range(L)) for k in range(N)]  # noqa: E741
    out_splits = [sum(outs[rank].numel() for rank in node) for node in nodes]
    arrived = out_going.new_empty(sum(out_splits))
    _between(engine, fn, steps, steps, out_going)
    engine.inter.all_to_all(arrived, out_going, out_splits, in_splits)
    for piece, rank in zip(arrived.split([outs[rank].numel() for node in nodes for rank in node]), sum(nodes, [])):
        outs[rank].copy_(piece)


# -- barrier ----------------------------------------------------------------------------------
def barrier(engine: SpanningEngine) -> None:
    L = engine.world_size
    steps = 3 if L > 1 else 1
    if L > 1:
        engine.barrier(algo=_node(engine, "barrier", 1, steps, None, 0))
    if engine.rank == 0:
        _between(engine, "barrier", 2 if L > 1 else 1, steps, None)
        engine.inter.barrier()
    if L > 1:
        engine.barrier(algo=_node(engine, "barrier", 3, steps, None, 0))
