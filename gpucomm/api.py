"""torch.distributed's module functions, on gpucomm's default communicator.

Swapping ``import torch.distributed as dist`` for ``import gpucomm as dist`` keeps a script
working: same names, same signatures and positional order (``tests/test_api_surface.py``
compares them with ``inspect.signature``), same rank conventions (``src``/``dst`` are global
ranks; ``group_src``/``group_dst`` are ranks within ``group``). Groups are
:class:`gpucomm.Communicator` objects; a torch process group of the ``gpucomm`` backend is
accepted too. Where gpucomm cannot do what an argument asks, the error says what to use instead.
The object collectives live in :mod:`gpucomm.objects`.
"""

from __future__ import annotations

import atexit
import datetime
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from gpucomm.communicator import Communicator, release_all
from gpucomm.config import Config
from gpucomm.errors import GpucommError, NotInitializedError, UnsupportedError
from gpucomm.reduce_op import ReduceOp
from gpucomm.rendezvous import release_stores, rendezvous
from gpucomm.story import NodeStatus
from gpucomm.work import Work

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "empty",
    "is_available",
    "is_initialized",
    "is_gloo_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_default_communicator",
    "status",
    "graph_safe",
    "check",
    "get_process_group_ranks",
    "get_global_rank",
    "get_group_rank",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "group",
    "GroupMember",
    "P2POp",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "broadcast",
    "all_reduce",
    "all_reduce_coalesced",
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

BACKEND_NAME = "gpucomm"
# torch.distributed's backend names, and what gpucomm serves each with: None = gpucomm's own
# paths (the workspace for CUDA tensors, gloo or GPUCOMM_TRANSPORT for CPU ones), "gloo" = every
# tensor of that device through gloo.
_DEVICE_BACKENDS = {"gpucomm": None, "nccl": None, "gloo": "gloo"}
_DEVICES = ("cpu", "cuda")


class _WorldMeta(type):
    """``group.WORLD`` / ``GroupMember.WORLD``: the default group once initialized, as in torch."""

    @property
    def WORLD(cls) -> Communicator | None:  # noqa: N802 (torch's name)
        return _State.world


class group(metaclass=_WorldMeta):  # noqa: N801 (torch's name)
    """``group.WORLD`` is the default group (None before ``init_process_group``)."""


class GroupMember(metaclass=_WorldMeta):
    """``GroupMember.WORLD`` is the default group; ``GroupMember.NON_GROUP_MEMBER`` is what
    :func:`new_group` returns on ranks outside the group."""

    NON_GROUP_MEMBER = object()


class _State:
    world: Communicator | None = None
    groups: list[Communicator] = []
    backend: str = BACKEND_NAME


def _transport_for(backend: str | None, fn: str) -> str | None:
    """The transport knob torch's ``backend`` string asks for (None: gpucomm's default paths).

    Accepts None, "gpucomm", "nccl", "gloo" and device maps such as "cuda:nccl,cpu:gloo".
    """
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(f"gpucomm.{fn}: backend must be a str or None, got {type(backend).__name__}")
    text = backend.strip().lower()
    pairs = [item.split(":", 1) for item in text.split(",")] if ":" in text else [[d, text] for d in _DEVICES]
    served: dict[str, str | None] = {}
    for pair in pairs:
        if len(pair) != 2 or pair[0].strip() not in _DEVICES:
            raise ValueError(f"gpucomm.{fn}: backend {backend!r}: device maps look like 'cuda:nccl,cpu:gloo' with devices {list(_DEVICES)}")
        device, name = pair[0].strip(), pair[1].strip()
        if name not in _DEVICE_BACKENDS:
            raise ValueError(
                f"gpucomm.{fn}: backend {name!r} is not one gpucomm serves; use None or 'gpucomm' (gpucomm's own "
                f"paths), 'nccl' (the same: gpucomm replaces NCCL), or 'gloo' (every call through gloo)"
            )
        served[device] = _DEVICE_BACKENDS[name]
    if served.get("cuda") == "gloo":
        # One transport serves every device of a communicator: CUDA tensors on gloo means
        # CPU tensors on gloo too, which is what gpucomm does for them by default.
        return "gloo"
    if "cuda" not in served and served.get("cpu") == "gloo":
        return "gloo"
    return None


def _device_for(device_id: object, fn: str) -> torch.device | None:
    if device_id is None:
        return None
    device = torch.device("cuda", device_id) if isinstance(device_id, int) and not isinstance(device_id, bool) else device_id
    if not isinstance(device, torch.device):
        raise TypeError(f"gpucomm.{fn}: device_id must be a torch.device or an int, got {type(device_id).__name__}")
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"gpucomm.{fn}: device_id must be a CUDA device with an index such as cuda:0, got {device}; CPU tensors need no device_id")
    if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"gpucomm.{fn}: device_id {device} does not exist on this host ({count} CUDA devices)")
    return device


def _seconds(timeout: object, fn: str) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        return float(timeout)
    raise TypeError(f"gpucomm.{fn}: timeout must be a datetime.timedelta or a number of seconds, got {type(timeout).__name__}")


def _knobs_of(pg_options: object, fn: str) -> dict[str, object]:
    from gpucomm.backend import Options

    if pg_options is None:
        return {}
    if not isinstance(pg_options, Options):
        raise TypeError(
            f"gpucomm.{fn}: pg_options must be a gpucomm.backend.Options (gpucomm's knobs), got "
            f"{type(pg_options).__name__}; a torch backend's options (e.g. NCCL's) do not apply to gpucomm"
        )
    return pg_options.knobs()


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | float | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: dist.Store | None = None,
    group_name: str = "",
    pg_options: object = None,
    device_id: torch.device | int | None = None,
    **knobs: object,
) -> None:
    """Join the default group: rendezvous, then build the gloo group and the workspace.

    Args:
        backend: None, "gpucomm" or "nccl": gpucomm's paths (the CUDA IPC workspace for CUDA
            tensors; for CPU tensors the shared-memory workspace when every rank is on this host,
            gloo otherwise); "gloo": every call through gloo;
            device maps such as "cuda:nccl,cpu:gloo" as torch writes them.
        init_method: "env://" (default; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK,
            LOCAL_WORLD_SIZE), "tcp://host:port" or "file://path".
        timeout: a timedelta (or seconds) for every wait; default GPUCOMM_TIMEOUT or 300 s.
        world_size, rank: override the environment (-1: read it).
        store: a torch.distributed Store to rendezvous on instead of init_method.
        group_name: accepted for torch's signature; the default group needs no name.
        pg_options: a :class:`gpucomm.backend.Options` (knobs), as the ``gpucomm`` backend takes.
        device_id: the CUDA device (or its index) of this rank; default: LOCAL_RANK's.
        **knobs: transport, kernels, algo, workspace_bytes, debug, local_world_size, check,
            channels (each overrides the GPUCOMM_* variable of the same name).

    Example::

        # torchrun --nproc-per-node 3 script.py
        import torch, gpucomm as dist
        dist.init_process_group()
        t = torch.ones(4) * dist.get_rank()
        dist.all_reduce(t)          # t == 0 + 1 + 2 on every rank
        dist.destroy_process_group()
    """
    fn = "init_process_group"
    if _State.world is not None:
        raise GpucommError("gpucomm.init_process_group: already initialized; call destroy_process_group() first")
    if not isinstance(group_name, str):
        raise TypeError(f"gpucomm.{fn}: group_name must be a str, got {type(group_name).__name__}")
    transport = _transport_for(backend, fn)
    device = _device_for(device_id, fn)
    settings = {**_knobs_of(pg_options, fn), **knobs}
    if transport is not None:
        if settings.get("transport", transport) != transport:
            raise ValueError(f"gpucomm.{fn}: backend {backend!r} means transport={transport!r}, but transport={settings['transport']!r} was given too")
        settings["transport"] = transport
    config = Config.from_env(timeout=_seconds(timeout, fn), **settings)
    rdv = rendezvous(init_method, None if rank == -1 else rank, None if world_size == -1 else world_size, store, config.timeout)
    _State.world = Communicator(
        rdv.store,
        rdv.rank,
        rdv.world_size,
        prefix=rdv.prefix,
        config=config,
        local_rank=rdv.local_rank,
        local_world_size=rdv.local_world_size,
        device=device,
    )
    _State.backend = "gloo" if config.transport == "gloo" else BACKEND_NAME


def destroy_process_group(group: object = None) -> None:
    """Close ``group``, or the default group and every subgroup when ``group`` is None."""
    if group is GroupMember.NON_GROUP_MEMBER:
        return
    if group is not None and group is not _State.world:
        comm = _as_communicator(group, "destroy_process_group")
        comm.close()
        if comm in _State.groups:
            _State.groups.remove(comm)
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


def is_available() -> bool:
    """gpucomm is always available where it imports."""
    return True


def is_initialized() -> bool:
    return _State.world is not None


def is_gloo_available() -> bool:
    """gpucomm's gloo path (and ``backend="gloo"``) needs torch's gloo."""
    return dist.is_gloo_available()


def is_nccl_available() -> bool:
    """``backend="nccl"`` is served by gpucomm's CUDA workspace: available where CUDA is."""
    return torch.cuda.is_available()


def is_torchelastic_launched() -> bool:
    return dist.is_torchelastic_launched()


def get_default_communicator() -> Communicator:
    """The default group's :class:`Communicator` (after ``init_process_group``)."""
    return _world("get_default_communicator")


def status(group: object = None) -> NodeStatus:
    """What every rank of this node is doing now, read from their flight records without
    sending anything (a rank stuck in a collective does not need to answer).

    ``str()`` of the result is a table: per rank, the call it is in (collective, call number,
    group, call site) and for how long, and the last call it completed and how long ago.
    ``GPUCOMM_STATUS_SIGNAL=SIGUSR1`` makes a rank print the same table when signalled.

    Example::

        print(gpucomm.status())          # or: kill -USR1 <pid of a rank>
    """
    comm = _world("status") if group is None else _as_communicator(group, "status")
    return comm.status()


def _world(fn: str) -> Communicator:
    if _State.world is None:
        raise NotInitializedError(f"gpucomm.{fn}: call gpucomm.init_process_group() first")
    return _State.world


def _as_communicator(group: object, fn: str) -> Communicator:
    """A gpucomm group: a Communicator, or a torch process group of the gpucomm backend."""
    if isinstance(group, Communicator):
        return group
    comm = getattr(group, "communicator", None)
    if isinstance(comm, Communicator):
        return comm
    raise TypeError(
        f"gpucomm.{fn}: group must be a group from gpucomm.new_group() (or a torch process group of the "
        f"'gpucomm' backend) or None, got {type(group).__name__}"
    )


def _group(group: object, fn: str) -> Communicator | None:
    """The communicator for ``group``; None (with torch.distributed's warning) outside it."""
    world = _world(fn)
    if group is None:
        return world
    if group is GroupMember.NON_GROUP_MEMBER:
        warnings.warn(f"gpucomm.{fn}: this rank is not part of the group; the call does nothing", stacklevel=3)
        return None
    return _as_communicator(group, fn)


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


def get_rank(group: object = None) -> int:
    comm = _group(group, "get_rank")
    return -1 if comm is None else comm.rank


def get_world_size(group: object = None) -> int:
    comm = _group(group, "get_world_size")
    return -1 if comm is None else comm.world_size


def get_backend(group: object = None) -> str:
    """"gpucomm", or "gloo" where ``backend="gloo"`` put every call of the job on gloo."""
    comm = _group(group, "get_backend")
    if comm is None:
        raise ValueError("gpucomm.get_backend: this rank is not part of the group")
    return "gloo" if comm.config.transport == "gloo" else BACKEND_NAME


def get_process_group_ranks(group: object) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order (None: the default group)."""
    comm = _group(group, "get_process_group_ranks")
    if comm is None:
        raise ValueError("gpucomm.get_process_group_ranks: this rank is not part of the group")
    return list(comm.global_ranks)


def get_global_rank(group: object, group_rank: int) -> int:
    """The global rank of ``group``'s member ``group_rank``."""
    ranks = get_process_group_ranks(group)
    if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < len(ranks):
        raise ValueError(f"gpucomm.get_global_rank: group_rank must be in [0, {len(ranks)}), got {group_rank!r}")
    return ranks[group_rank]


def get_group_rank(group: object, global_rank: int) -> int:
    """``global_rank``'s rank within ``group``."""
    ranks = get_process_group_ranks(group)
    if global_rank not in ranks:
        raise ValueError(f"gpucomm.get_group_rank: global rank {global_rank!r} is not part of the group (ranks {ranks})")
    return ranks.index(global_rank)


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: datetime.timedelta | float | None = None,
    backend: str | None = None,
    pg_options: object = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: torch.device | None = None,
    sort_ranks: bool = True,
) -> object:
    """A subgroup of the default group. Every rank of the default group must call it, in the same order.

    ``timeout`` (a timedelta or seconds) applies to the subgroup's calls; ``backend`` ("gloo",
    "nccl", "gpucomm", None) and ``pg_options`` (a :class:`gpucomm.backend.Options`) set its
    knobs; ``sort_ranks=False`` numbers its members in the order of ``ranks``. Returns
    ``GroupMember.NON_GROUP_MEMBER`` on the other ranks.
    """
    fn = "new_group"
    world = _world(fn)
    if use_local_synchronization:
        raise UnsupportedError(
            "gpucomm.new_group: use_local_synchronization=True is not supported: gpucomm's new_group is "
            "collective over the default group; call it on every rank (use_local_synchronization=False)"
        )
    if device_id is not None and _device_for(device_id, fn) != world.device:
        raise ValueError(f"gpucomm.{fn}: device_id {device_id} differs from this rank's device {world.device}; subgroups use it")
    members = list(range(world.world_size)) if ranks is None else list(ranks)
    knobs = _knobs_of(pg_options, fn)
    transport = _transport_for(backend, fn)
    if transport is not None:
        knobs["transport"] = transport
    comm = world.new_subgroup(members, _seconds(timeout, fn), sort=sort_ranks, **knobs)
    if comm is None:
        return GroupMember.NON_GROUP_MEMBER
    _State.groups.append(comm)
    return comm


def new_subgroups(
    group_size: int | None = None,
    group: object = None,
    timeout: datetime.timedelta | float | None = None,
    backend: str | None = None,
    pg_options: object = None,
    group_desc: str | None = None,
) -> tuple[object, list[object]]:
    """Split the default group (or ``group``; every member calls it) into consecutive subgroups
    of ``group_size`` ranks (default: the ranks of one node); returns this rank's subgroup and
    all of them (``GroupMember.NON_GROUP_MEMBER`` for those this rank is not in)."""
    fn = "new_subgroups"
    parent = _world(fn) if group is None else _as_communicator(group, fn)
    size = parent.local_world_size if group_size is None else group_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or parent.world_size % size:
        raise ValueError(f"gpucomm.{fn}: group_size must be a positive divisor of the group's size {parent.world_size}, got {group_size!r}")
    ranks = parent.global_ranks
    return _subgroups(parent, [ranks[i : i + size] for i in range(0, len(ranks), size)], timeout, backend, pg_options, fn)


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: datetime.timedelta | float | None = None,
    backend: str | None = None,
    pg_options: object = None,
    group_desc: str | None = None,
) -> tuple[object, list[object]]:
    """One subgroup per list of global ranks (disjoint lists; every rank calls it); returns this
    rank's subgroup (None if it is in none) and all of them."""
    fn = "new_subgroups_by_enumeration"
    return _subgroups(_world(fn), [list(r) for r in ranks_per_subgroup_list], timeout, backend, pg_options, fn)


def _subgroups(parent: Communicator, lists: list[list[int]], timeout: object, backend: str | None, pg_options: object, fn: str) -> tuple[object, list[object]]:
    """Subgroups of ``parent`` (collective over it), one per list of global ranks."""
    seen: set[int] = set()
    for ranks in lists:
        outside = set(ranks) - set(parent.global_ranks)
        if outside:
            raise ValueError(f"gpucomm.{fn}: rank(s) {sorted(outside)} are not in the parent group (ranks {parent.global_ranks})")
        if seen & set(ranks):
            raise ValueError(f"gpucomm.{fn}: rank(s) {sorted(seen & set(ranks))} appear in more than one subgroup")
        seen |= set(ranks)
    knobs = _knobs_of(pg_options, fn)
    transport = _transport_for(backend, fn)
    if transport is not None:
        knobs["transport"] = transport
    me = parent.global_ranks[parent.rank]
    mine: object = None
    groups: list[object] = []
    for ranks in lists:
        comm = parent.new_subgroup([parent.global_ranks.index(r) for r in ranks], _seconds(timeout, fn), **knobs)
        if comm is None:
            groups.append(GroupMember.NON_GROUP_MEMBER)
            continue
        _State.groups.append(comm)
        groups.append(comm)
        if me in ranks:
            mine = comm
    return mine, groups


# -- collectives ------------------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` over the group, in place, on every rank (torch.distributed's call).

    Deterministic by contract: an element's bits depend only on its inputs on every rank, its
    dtype and op, and the group's layout, never on the size, algorithm, channels, kernels or
    arrival order (rank order in the accumulation type, one rounding; see
    :meth:`gpucomm.Communicator.all_reduce`).
    """
    comm = _group(group, "all_reduce")
    return None if comm is None else comm.all_reduce(tensor, op, async_op)


def reduce(tensor: torch.Tensor, dst: int | None = None, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` over the group into ``dst``'s tensor; deterministic by contract, with
    the bits :func:`all_reduce` gives (see :meth:`gpucomm.Communicator.all_reduce`)."""
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
    """``output`` on rank i = the reduction of every rank's ``input_list[i]``; deterministic by
    contract, with the bits :func:`all_reduce` gives (see :meth:`gpucomm.Communicator.all_reduce`)."""
    comm = _group(group, "reduce_scatter")
    return None if comm is None else comm.reduce_scatter(output, input_list, op, async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False) -> Work | None:
    """``output`` on rank i = the reduction of chunk i of every rank's ``input``; deterministic by
    contract, with the bits :func:`all_reduce` gives (see :meth:`gpucomm.Communicator.all_reduce`)."""
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


def empty(*size: object, dtype: torch.dtype | None = None, device: object = None, group: object = None) -> torch.Tensor | None:
    """A tensor in the symmetric heap of ``group`` (default: the default group): collective, with
    ``torch.empty``'s arguments; see :meth:`Communicator.empty`. Collectives on it read every
    rank's copy in place. None on a rank outside ``group``."""
    comm = _group(group, "empty")
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
    comm = _group(group, "graph_safe")
    return comm is not None and comm.graph_safe()


def check(group: object = None) -> None:
    """Raise the error that ended a collective of ``group`` (default: the default group), if
    one did, without waiting: the way to hear of a timeout inside a replayed CUDA graph, whose
    collectives no Work watches. The next eager call and ``Work.wait()`` raise it too.

    Example::

        g.replay()
        gpucomm.check()    # CommTimeoutError if a peer never arrived during the replay
    """
    comm = _group(group, "check")
    if comm is not None:
        comm.check()


def barrier(group: object = None, async_op: bool = False, device_ids: Sequence[int] | None = None, timeout: datetime.timedelta | None = None) -> Work | None:
    """Return once every rank of ``group`` has entered the barrier.

    ``device_ids``: accepted when it names this rank's own GPU (gpucomm knows its device).
    ``timeout``: a per-call timeout is not supported; set the group's (init_process_group or
    new_group ``timeout=``), or use :func:`monitored_barrier`, which takes one.
    """
    fn = "barrier"
    comm = _group(group, fn)
    if comm is None:
        return None
    if timeout is not None:
        raise UnsupportedError(
            f"gpucomm.{fn}: a per-call timeout is not supported; give the group one "
            "(init_process_group(timeout=...) or new_group(timeout=...)), or call monitored_barrier(timeout=...)"
        )
    if device_ids is not None:
        mine = [] if comm.device is None else [comm.device.index]
        if list(device_ids) != mine:
            raise ValueError(f"gpucomm.{fn}: device_ids must name this rank's device {mine} (or be None), got {list(device_ids)}")
    return comm.barrier(async_op)


def monitored_barrier(group: object = None, timeout: datetime.timedelta | float | None = None, wait_all_ranks: bool = False) -> None:
    """A barrier that ends in :class:`gpucomm.CommTimeoutError` naming the ranks that did not
    arrive within ``timeout`` (default: the group's); ``wait_all_ranks=True`` names all of
    them, not just the first (rank 0 collects, as with torch's gloo)."""
    comm = _group(group, "monitored_barrier")
    if comm is not None:
        comm.monitored_barrier(_seconds(timeout, "monitored_barrier"), wait_all_ranks)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: object = ReduceOp.SUM, group: object = None, async_op: bool = False) -> Work | None:
    """:func:`all_reduce` of each tensor of ``tensors`` (same dtype), in order."""
    fn = "all_reduce_coalesced"
    comm = _group(group, fn)
    if comm is None:
        return None
    items = _tensor_list(tensors, fn, "tensors")
    return _all_of([comm.all_reduce(t, op, async_op=True) for t in items], async_op)


def all_gather_coalesced(output_tensor_lists: list[list[torch.Tensor]], input_tensor_list: list[torch.Tensor], group: object = None, async_op: bool = False) -> Work | None:
    """For each k, ``output_tensor_lists[r][k]`` = ``input_tensor_list[k]`` of rank r (the
    outer list is rank-major, as torch's)."""
    fn = "all_gather_coalesced"
    comm = _group(group, fn)
    if comm is None:
        return None
    inputs = _tensor_list(input_tensor_list, fn, "input_tensor_list")
    if not isinstance(output_tensor_lists, list) or len(output_tensor_lists) != comm.world_size:
        got = len(output_tensor_lists) if isinstance(output_tensor_lists, list) else type(output_tensor_lists).__name__
        raise ValueError(f"gpucomm.{fn}: output_tensor_lists must hold one list per rank ({comm.world_size}), got {got}")
    for r, outs in enumerate(output_tensor_lists):
        if len(_tensor_list(outs, fn, f"output_tensor_lists[{r}]")) != len(inputs):
            raise ValueError(f"gpucomm.{fn}: output_tensor_lists[{r}] must hold {len(inputs)} tensors (one per input), got {len(outs)}")
    return _all_of([comm.all_gather([outs[k] for outs in output_tensor_lists], t, async_op=True) for k, t in enumerate(inputs)], async_op)


def _tensor_list(tensors: object, fn: str, name: str) -> list[torch.Tensor]:
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"gpucomm.{fn}: {name} must be a list of tensors, got {type(tensors).__name__}")
    return list(tensors)


def _all_of(works: list[Work | None], async_op: bool) -> Work | None:
    """One Work for several started calls (their results in order)."""
    started = [w for w in works if w is not None]
    combined = Work(started)
    combined.outputs = [t for w in started for t in w.outputs]
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
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list or not all(isinstance(p, P2POp) for p in p2p_op_list):
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
