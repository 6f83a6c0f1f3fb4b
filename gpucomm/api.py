"""torch.distributed's module functions, on gpucomm's default communicator.

Swapping ``import torch.distributed as dist`` for ``import gpucomm as dist`` keeps a script
working: same names, same signatures, same rank conventions (``src``/``dst`` are global ranks;
``group_src``/``group_dst`` are ranks within ``group``).
"""

from __future__ import annotations

import atexit
import datetime
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gpucomm.communicator import Communicator, release_all
from gpucomm.config import Config
from gpucomm.errors import GpucommError, NotInitializedError
from gpucomm.reduce_op import ReduceOp
from gpucomm.rendezvous import release_stores, rendezvous
from gpucomm.work import Work

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "get_default_communicator",
    "new_group",
    "GroupMember",
    "send",
    "recv",
    "isend",
    "irecv",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
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
]

_BACKENDS = ("auto", "gpucomm", "gloo")


class GroupMember:
    """``GroupMember.NON_GROUP_MEMBER`` is what :func:`new_group` returns on ranks outside the group."""

    NON_GROUP_MEMBER = object()


class _State:
    world: Communicator | None = None
    groups: list[Communicator] = []


def init_process_group(
    backend: str = "auto",
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    store: dist.Store | None = None,
    timeout: object = None,
    **knobs: object,
) -> None:
    """Join the default group: rendezvous, then build the gloo group and the workspace.

    Args:
        backend: "auto" (or "gpucomm"): the workspace path where it applies, gloo elsewhere;
            "gloo": every call through gloo (the same as ``transport="gloo"``).
        init_method: "env://" (default; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK,
            LOCAL_WORLD_SIZE), "tcp://host:port" or "file://path".
        rank, world_size: override the environment.
        store: a torch.distributed Store to rendezvous on instead of init_method.
        timeout: seconds (or a timedelta) for every wait; default GPUCOMM_TIMEOUT or 300 s.
        **knobs: transport, kernels, algo, workspace_bytes, debug, local_world_size, check
            (each overrides the GPUCOMM_* variable of the same name).

    Example::

        # torchrun --nproc-per-node 3 script.py
        import torch, gpucomm as dist
        dist.init_process_group()
        t = torch.ones(4) * dist.get_rank()
        dist.all_reduce(t)          # t == 0 + 1 + 2 on every rank
        dist.destroy_process_group()
    """
    if _State.world is not None:
        raise GpucommError("gpucomm.init_process_group: already initialized; call destroy_process_group() first")
    if backend not in _BACKENDS:
        raise ValueError(f"gpucomm.init_process_group: backend must be one of {list(_BACKENDS)}, got {backend!r}")
    if backend == "gloo":
        knobs["transport"] = "gloo"
    config = Config.from_env(timeout=timeout, **knobs)
    rdv = rendezvous(init_method, rank, world_size, store, config.timeout)
    _State.world = Communicator(
        rdv.store,
        rdv.rank,
        rdv.world_size,
        prefix=rdv.prefix,
        config=config,
        local_rank=rdv.local_rank,
        local_world_size=rdv.local_world_size,
    )


def destroy_process_group(group: Communicator | None = None) -> None:
    """Close ``group``, or the default group and every subgroup when ``group`` is None."""
    if group is not None and group is not _State.world:
        if isinstance(group, Communicator):
            group.close()
            if group in _State.groups:
                _State.groups.remove(group)
        return
    world, groups = _State.world, _State.groups
    _State.world, _State.groups = None, []
    for comm in groups:
        comm.close()
    if world is not None:
        world.close()


@atexit.register
def _release_at_exit() -> None:
    """A process that never called destroy_process_group stops gpucomm's threads (gloo's, the
    stores') before the interpreter tears itself down, so that it exits cleanly."""
    _State.world, _State.groups = None, []
    release_all()
    release_stores()


def is_initialized() -> bool:
    return _State.world is not None


def get_default_communicator() -> Communicator:
    """The default group's :class:`Communicator` (after ``init_process_group``)."""
    return _world("get_default_communicator")


def _world(fn: str) -> Communicator:
    if _State.world is None:
        raise NotInitializedError(f"gpucomm.{fn}: call gpucomm.init_process_group() first")
    return _State.world


def _group(group: object, fn: str) -> Communicator | None:
    """The communicator for ``group``; None (with torch.distributed's warning) outside it."""
    world = _world(fn)
    if group is None:
        return world
    if group is GroupMember.NON_GROUP_MEMBER:
        warnings.warn(f"gpucomm.{fn}: this rank is not part of the group; the call does nothing", stacklevel=3)
        return None
    if not isinstance(group, Communicator):
        raise TypeError(f"gpucomm.{fn}: group must be a group from gpucomm.new_group() or None, got {type(group).__name__}")
    return group


def _group_rank(comm: Communicator, rank: int | None, group_rank: int | None, fn: str, name: str, default: int | None = 0) -> int | None:
    """torch.distributed's rule: ``src``/``dst`` are global ranks, ``group_src``/``group_dst`` group ranks."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"gpucomm.{fn}: pass {name} or group_{name}, not both")
    if group_rank is not None:
        return group_rank
    if rank is None:
        return default
    if rank not in comm.global_ranks:
        raise ValueError(f"gpucomm.{fn}: {name}={rank} is not a member of the group (ranks {comm.global_ranks})")
    return comm.global_ranks.index(rank)


def get_rank(group: Communicator | None = None) -> int:
    comm = _group(group, "get_rank")
    return -1 if comm is None else comm.rank


def get_world_size(group: Communicator | None = None) -> int:
    comm = _group(group, "get_world_size")
    return -1 if comm is None else comm.world_size


def new_group(ranks: Sequence[int] | None = None, timeout: object = None, backend: object = None, **_: object) -> object:
    """A subgroup of the default group. Every rank of the default group must call it, in the same order.

    ``timeout`` (seconds or a timedelta) applies to the subgroup's calls; ``backend`` and
    torch.distributed's other options are accepted and ignored (the subgroup uses the knobs of
    the default group).
    """
    world = _world("new_group")
    members = list(range(world.world_size)) if ranks is None else list(ranks)
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    comm = world.new_subgroup(members, None if seconds is None else float(seconds))  # type: ignore[arg-type]
    if comm is None:
        return GroupMember.NON_GROUP_MEMBER
    _State.groups.append(comm)
    return comm


# -- collectives ------------------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False) -> Work | None:
    comm = _group(group, "all_reduce")
    return None if comm is None else comm.all_reduce(tensor, op, async_op)


def reduce(tensor: torch.Tensor, dst: int | None = None, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False, group_dst: int | None = None) -> Work | None:
    comm = _group(group, "reduce")
    if comm is None:
        return None
    return comm.reduce(tensor, _group_rank(comm, dst, group_dst, "reduce", "dst"), op, async_op)


def broadcast(tensor: torch.Tensor, src: int | None = None, group: object = None, async_op: bool = False, group_src: int | None = None) -> Work | None:
    comm = _group(group, "broadcast")
    if comm is None:
        return None
    return comm.broadcast(tensor, _group_rank(comm, src, group_src, "broadcast", "src"), async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: object = None, async_op: bool = False) -> Work | None:
    comm = _group(group, "all_gather")
    return None if comm is None else comm.all_gather(tensor_list, tensor, async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: object = None, async_op: bool = False) -> Work | None:
    comm = _group(group, "all_gather_into_tensor")
    return None if comm is None else comm.all_gather_into_tensor(output_tensor, input_tensor, async_op)


def all_gather_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: object = None, async_op: bool = False) -> Work | None:
    """torch 2.13's name for :func:`all_gather_into_tensor`."""
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int | None = None, group: object = None, async_op: bool = False, group_dst: int | None = None) -> Work | None:
    comm = _group(group, "gather")
    if comm is None:
        return None
    return comm.gather(tensor, gather_list, _group_rank(comm, dst, group_dst, "gather", "dst"), async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int | None = None, group: object = None, async_op: bool = False, group_src: int | None = None) -> Work | None:
    comm = _group(group, "scatter")
    if comm is None:
        return None
    return comm.scatter(tensor, scatter_list, _group_rank(comm, src, group_src, "scatter", "src"), async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: object = ReduceOp.SUM, group: object = None, async_op: bool = False) -> Work | None:
    comm = _group(group, "reduce_scatter")
    return None if comm is None else comm.reduce_scatter(output, input_list, op, async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False) -> Work | None:
    comm = _group(group, "reduce_scatter_tensor")
    return None if comm is None else comm.reduce_scatter_tensor(output, input, op, async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False) -> Work | None:
    """torch 2.13's name for :func:`reduce_scatter_tensor`."""
    return reduce_scatter_tensor(output, input, op, group, async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: object = None, async_op: bool = False) -> Work | None:
    comm = _group(group, "all_to_all")
    return None if comm is None else comm.all_to_all(output_tensor_list, input_tensor_list, async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Sequence[int] | None = None, input_split_sizes: Sequence[int] | None = None, group: object = None, async_op: bool = False) -> Work | None:
    comm = _group(group, "all_to_all_single")
    return None if comm is None else comm.all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)


def send(tensor: torch.Tensor, dst: int | None = None, group: object = None, tag: int = 0, group_dst: int | None = None) -> None:
    comm = _group(group, "send")
    if comm is not None:
        comm.send(tensor, _group_rank(comm, dst, group_dst, "send", "dst", default=None), tag)  # type: ignore[arg-type]


def recv(tensor: torch.Tensor, src: int | None = None, group: object = None, tag: int = 0, group_src: int | None = None) -> int:
    comm = _group(group, "recv")
    if comm is None:
        return -1
    source = comm.recv(tensor, _group_rank(comm, src, group_src, "recv", "src", default=None), tag)
    return comm.global_ranks[source]


def isend(tensor: torch.Tensor, dst: int | None = None, group: object = None, tag: int = 0, group_dst: int | None = None) -> Work | None:
    comm = _group(group, "isend")
    if comm is None:
        return None
    return comm.isend(tensor, _group_rank(comm, dst, group_dst, "isend", "dst", default=None), tag)  # type: ignore[arg-type]


def irecv(tensor: torch.Tensor, src: int | None = None, group: object = None, tag: int = 0, group_src: int | None = None) -> Work | None:
    comm = _group(group, "irecv")
    if comm is None:
        return None
    return comm.irecv(tensor, _group_rank(comm, src, group_src, "irecv", "src", default=None), tag)


def barrier(group: object = None, async_op: bool = False, device_ids: object = None, timeout: object = None) -> Work | None:
    comm = _group(group, "barrier")
    return None if comm is None else comm.barrier(async_op)
