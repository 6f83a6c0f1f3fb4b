"""The module-level collectives of torch.distributed, each forwarded to its group's Communicator.

``src``/``dst`` are global ranks, ``group_src``/``group_dst`` ranks within ``group``, as in
torch.distributed (:func:`gpucomm.distributed.lookup.group_rank`). On a rank outside ``group``
each call does nothing and returns None (``recv``: -1), with torch.distributed's warning. All ranks in the
group must call a collective simultaneously, in the same order.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from gpucomm.distributed.arguments import seconds_of
from gpucomm.distributed.lookup import find, group_rank
from gpucomm.errors import UnsupportedError
from gpucomm.reduce_op import ReduceOp
from gpucomm.work import Work

__all__ = [
    "empty",
    "graph_safe",
    "register_graph_buffers",
    "graph_capture",
    "check",
    "P2POp",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "broadcast",
    "all_reduce",
    "all_reduce_coalesced",
    "all_reduce_into",
    "reduce",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_single",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "supports_complex",
]


def all_reduce(
    tensor: torch.Tensor, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False
) -> Work | None:
    """Reduce ``tensor`` over the group, in place, on every rank (torch.distributed's call).

    Deterministic by contract: an element's bits depend only on its inputs on every rank, its
    dtype and op, and the group's layout, never on the size, algorithm, channels, kernels or
    arrival order (rank order in the accumulation type, one rounding; see
    :meth:`gpucomm.Communicator.all_reduce`).
    """
    comm = find(group, "all_reduce")
    return None if comm is None else comm.all_reduce(tensor, op, async_op)


def all_reduce_into(
    output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False
) -> Work | None:
    """``output`` = the reduction of every rank's ``input`` over the group; ``input`` is left unchanged.

    Output first, as :func:`all_gather_into_tensor`. The bits of :func:`all_reduce` on a copy of
    ``input``; on the workspace one-shot, two-shot and ring write ``output`` with no pass more than
    the in-place call (see :meth:`gpucomm.Communicator.all_reduce_into`, which says where it copies
    and then reduces in place instead). gpucomm's own call: torch.distributed has none.
    """
    comm = find(group, "all_reduce_into")
    return None if comm is None else comm.all_reduce_into(output, input, op, async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int | None = None,
    op: object = ReduceOp.SUM,
    group: object = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Reduce ``tensor`` over the group into ``dst``'s tensor; deterministic by contract, with
    the bits :func:`all_reduce` gives (see :meth:`gpucomm.Communicator.all_reduce`)."""
    comm = find(group, "reduce")
    if comm is None:
        return None
    return comm.reduce(tensor, group_rank(comm, dst, group_dst, "reduce", "dst"), op, async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: object = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    comm = find(group, "broadcast")
    if comm is None:
        return None
    return comm.broadcast(tensor, group_rank(comm, src, group_src, "broadcast", "src"), async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: object = None, async_op: bool = False
) -> Work | None:
    comm = find(group, "all_gather")
    return None if comm is None else comm.all_gather(tensor_list, tensor, async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: object = None, async_op: bool = False
) -> Work | None:
    comm = find(group, "all_gather_into_tensor")
    return None if comm is None else comm.all_gather_into_tensor(output_tensor, input_tensor, async_op)


def all_gather_single(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: object = None, async_op: bool = False
) -> Work | None:
    """torch 2.13's name for :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int | None = None,
    group: object = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    comm = find(group, "gather")
    if comm is None:
        return None
    return comm.gather(tensor, gather_list, group_rank(comm, dst, group_dst, "gather", "dst"), async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int | None = None,
    group: object = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    comm = find(group, "scatter")
    if comm is None:
        return None
    return comm.scatter(tensor, scatter_list, group_rank(comm, src, group_src, "scatter", "src"), async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: object = ReduceOp.SUM,
    group: object = None,
    async_op: bool = False,
) -> Work | None:
    """``output`` on rank i = the reduction of every rank's ``input_list[i]``; deterministic by
    contract, with the bits :func:`all_reduce` gives (see :meth:`gpucomm.Communicator.all_reduce`)."""
    comm = find(group, "reduce_scatter")
    return None if comm is None else comm.reduce_scatter(output, input_list, op, async_op)


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False
) -> Work | None:
    """``output`` on rank i = the reduction of chunk i of every rank's ``input``; deterministic by
    contract, with the bits :func:`all_reduce` gives (see :meth:`gpucomm.Communicator.all_reduce`)."""
    comm = find(group, "reduce_scatter_tensor")
    return None if comm is None else comm.reduce_scatter_tensor(output, input, op, async_op)


def reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False
) -> Work | None:
    """torch 2.13's name for :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: object = None,
    async_op: bool = False,
) -> Work | None:
    comm = find(group, "all_to_all")
    return None if comm is None else comm.all_to_all(output_tensor_list, input_tensor_list, async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: object = None,
    async_op: bool = False,
) -> Work | None:
    comm = find(group, "all_to_all_single")
    return (
        None if comm is None else comm.all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)
    )


def send(
    tensor: torch.Tensor, dst: int | None = None, group: object = None, tag: int = 0, group_dst: int | None = None
) -> None:
    comm = find(group, "send")
    if comm is not None:
        comm.send(tensor, group_rank(comm, dst, group_dst, "send", "dst", default=None), tag)  # type: ignore[arg-type]


def recv(
    tensor: torch.Tensor, src: int | None = None, group: object = None, tag: int = 0, group_src: int | None = None
) -> int:
    comm = find(group, "recv")
    if comm is None:
        return -1
    source = comm.recv(tensor, group_rank(comm, src, group_src, "recv", "src", default=None), tag)
    return comm.global_ranks[source]


def isend(
    tensor: torch.Tensor, dst: int | None = None, group: object = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    comm = find(group, "isend")
    if comm is None:
        return None
    return comm.isend(tensor, group_rank(comm, dst, group_dst, "isend", "dst", default=None), tag)  # type: ignore[arg-type]


def irecv(
    tensor: torch.Tensor, src: int | None = None, group: object = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    comm = find(group, "irecv")
    if comm is None:
        return None
    return comm.irecv(tensor, group_rank(comm, src, group_src, "irecv", "src", default=None), tag)


def empty(
    *size: object, dtype: torch.dtype | None = None, device: object = None, group: object = None
) -> torch.Tensor | None:
    """A tensor in the symmetric heap of ``group`` (default: the default group): collective, with
    ``torch.empty``'s arguments; see :meth:`Communicator.empty`. Collectives on it read every
    rank's copy in place. None on a rank outside ``group``."""
    comm = find(group, "empty")
    if comm is None:
        return None
    return comm.empty(*size, dtype=dtype, device=device)


def graph_safe(group: object = None) -> bool:
    """Whether collectives on CUDA tensors of ``group`` (default: the default group) can be
    captured in a CUDA graph now: its GPU workspace runs the program kernel and nothing failed.

    Warm up first: run each collective once, eagerly, with the tensors the graph will use (its
    program is built on first use); then capture it on a side stream as any CUDA graph, e.g.::

        gpucomm.all_reduce(t)                       # warm-up: builds the program
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            gpucomm.all_reduce(t)
        t.copy_(fresh); g.replay()                  # every replay reduces what t holds then
    """
    comm = find(group, "graph_safe")
    return comm is not None and comm.graph_safe()


def graph_capture(graph: object = None, group: object = None) -> contextlib.AbstractContextManager:
    """Around CUDA graph captures on every rank of ``group`` (default: the default group): the
    all_reduces and broadcasts captured on ordinary tensors run in place at replay, with no copy
    in or out, where every rank's tensor can be shared (:meth:`gpucomm.Communicator.graph_capture`)::

        gpucomm.all_reduce(t)                     # warm-up, as for any capture
        with gpucomm.graph_capture(g):            # registers the peers' segments on leaving
            with torch.cuda.graph(g):
                gpucomm.all_reduce(t)
        g.replay()                                # in place on t; the segments live as long as g
    """
    comm = find(group, "graph_capture")
    return contextlib.nullcontext() if comm is None else comm.graph_capture(graph)


def register_graph_buffers(graph: object = None, group: object = None) -> None:
    """What :func:`graph_capture` does on leaving, on every rank of ``group``: the calls captured in
    place since the last registration exchange their segments, so that ``graph`` may replay
    (:meth:`gpucomm.Communicator.register_graph_buffers`)."""
    comm = find(group, "register_graph_buffers")
    if comm is not None:
        comm.register_graph_buffers(graph)


def check(group: object = None) -> None:
    """Raise the error that ended a collective of ``group`` (default: the default group), if
    one did, without waiting: the way to hear of a timeout inside a replayed CUDA graph, whose
    collectives no Work watches. The next eager call and ``Work.wait()`` raise it too.

    Example::

        g.replay()
        gpucomm.check()    # CommTimeoutError if a peer never arrived during the replay
    """
    comm = find(group, "check")
    if comm is not None:
        comm.check()


def barrier(
    group: object = None,
    async_op: bool = False,
    device_ids: Sequence[int] | None = None,
    timeout: datetime.timedelta | None = None,
) -> Work | None:
    """Return once every rank of ``group`` has entered the barrier.

    ``device_ids``: accepted when it names this rank's own GPU (gpucomm knows its device).
    ``timeout``: a per-call timeout is not supported; set the group's (init_process_group or
    new_group ``timeout=``), or use :func:`monitored_barrier`, which takes one.
    """
    fn = "barrier"
    comm = find(group, fn)
    if comm is None:
        return None
    if timeout is not None:
        raise UnsupportedError(
            f"gpucomm.{fn}: a per-call timeout is not supported; give the group one "
            "(init_processfind(timeout=...) or newfind(timeout=...)), or call monitored_barrier(timeout=...)"
        )
    if device_ids is not None:
        mine = [] if comm.device is None else [comm.device.index]
        if list(device_ids) != mine:
            raise ValueError(
                f"gpucomm.{fn}: device_ids must name this rank's device {mine} (or be None), got {list(device_ids)}"
            )
    return comm.barrier(async_op)


def monitored_barrier(
    group: object = None, timeout: datetime.timedelta | float | None = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that ends in :class:`gpucomm.CommTimeoutError` naming the ranks that did not
    arrive within ``timeout`` (default: the group's); ``wait_all_ranks=True`` names all of
    them, not just the first (rank 0 collects, as with torch's gloo)."""
    comm = find(group, "monitored_barrier")
    if comm is not None:
        comm.monitored_barrier(seconds_of(timeout, "monitored_barrier"), wait_all_ranks)


def all_reduce_coalesced(
    tensors: list[torch.Tensor], op: object = ReduceOp.SUM, group: object = None, async_op: bool = False
) -> Work | None:
    """:func:`all_reduce` of each tensor of ``tensors`` (same dtype), in order."""
    fn = "all_reduce_coalesced"
    comm = find(group, fn)
    if comm is None:
        return None
    items = _tensor_list(tensors, fn, "tensors")
    return _all_of([comm.all_reduce(t, op, async_op=True) for t in items], async_op)


def all_gather_coalesced(
    output_tensor_lists: list[list[torch.Tensor]],
    input_tensor_list: list[torch.Tensor],
    group: object = None,
    async_op: bool = False,
) -> Work | None:
    """For each k, ``output_tensor_lists[r][k]`` = ``input_tensor_list[k]`` of rank r (the
    outer list is rank-major, as torch's)."""
    fn = "all_gather_coalesced"
    comm = find(group, fn)
    if comm is None:
        return None
    inputs = _tensor_list(input_tensor_list, fn, "input_tensor_list")
    if not isinstance(output_tensor_lists, list) or len(output_tensor_lists) != comm.world_size:
        got = len(output_tensor_lists) if isinstance(output_tensor_lists, list) else type(output_tensor_lists).__name__
        raise ValueError(
            f"gpucomm.{fn}: output_tensor_lists must hold one list per rank ({comm.world_size}), got {got}"
        )
    for r, outs in enumerate(output_tensor_lists):
        if len(_tensor_list(outs, fn, f"output_tensor_lists[{r}]")) != len(inputs):
            raise ValueError(
                f"gpucomm.{fn}: output_tensor_lists[{r}] must hold {len(inputs)} tensors (one per input), "
                f"got {len(outs)}"
            )
    return _all_of(
        [comm.all_gather([outs[k] for outs in output_tensor_lists], t, async_op=True) for k, t in enumerate(inputs)],
        async_op,
    )


def _tensor_list(tensors: object, fn: str, name: str) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"gpucomm.{fn}: {name} must be a list of tensors, got {type(tensors).__name__}")
    return list(tensors)


def _all_of(works: list[Work | None], async_op: bool) -> Work | None:
    """One Work for several started calls (their results in order)."""
    started = [w for w in works if w is not None]
    combined = Work(started, outputs=[t for w in started for t in w.outputs])
    if async_op:
        return combined
    combined.wait()
    return None


class P2POp:
    """One operation of :func:`batch_isend_irecv`: ``op`` is :func:`isend` or :func:`irecv`
    (gpucomm's or torch.distributed's), ``peer`` a global rank or ``group_peer`` a group rank."""

    def __init__(
        self,
        op: Callable[..., object],
        tensor: torch.Tensor,
        peer: int | None = None,
        group: object = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        sending = op in (isend, dist.isend)
        if not sending and op not in (irecv, dist.irecv):
            raise ValueError(f"gpucomm.P2POp: op must be gpucomm.isend or gpucomm.irecv, got {op!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"gpucomm.P2POp: tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if (peer is None) == (group_peer is None):
            raise ValueError("gpucomm.P2POp: pass exactly one of peer or group_peer")
        self.op = isend if sending else irecv
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, group_peer={self.group_peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every send and receive of ``p2p_op_list`` and return their Works (in order).

    Each starts without waiting for the others, so the order of the list does not matter:
    a ring of sends and receives, or both directions between two ranks, completes.
    """
    fn = "batch_isend_irecv"
    if (
        not isinstance(p2p_op_list, (list, tuple))
        or not p2p_op_list
        or not all(isinstance(p, P2POp) for p in p2p_op_list)
    ):
        raise ValueError(f"gpucomm.{fn}: p2p_op_list must be a non-empty list of gpucomm.P2POp")
    groups = {id(p.group) for p in p2p_op_list}
    if len(groups) != 1:
        raise ValueError(f"gpucomm.{fn}: every P2POp of one batch must use the same group")
    works = []
    for p in p2p_op_list:
        key = "group_dst" if p.op is isend else "group_src"
        peer = {key: p.group_peer} if p.group_peer is not None else {key[len("group_") :]: p.peer}
        work = p.op(p.tensor, group=p.group, tag=p.tag, **peer)
        if work is not None:
            works.append(work)
    return works


def supports_complex(reduceOp: object) -> bool:  # noqa: N803 (torch's name)
    """Whether ``reduceOp`` is defined on complex tensors (SUM and AVG; PREMUL_SUM too)."""
    from gpucomm.reduce_op import PremulSum, as_reduce_op

    if isinstance(reduceOp, PremulSum):
        return True
    return as_reduce_op(reduceOp, "supports_complex") in (ReduceOp.SUM, ReduceOp.AVG)
