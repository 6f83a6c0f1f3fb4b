"""torch.distributed's module functions, on gpucomm's default communicator.

Swapping ``import torch.distributed as dist`` for ``import gpucomm as dist`` keeps a script
working: same names, same signatures and positional order (``tests/distributed/test_signatures.py``
compares them with ``inspect.signature``), same rank conventions (``src``/``dst`` are global
ranks; ``group_src``/``group_dst`` are ranks within ``group``). Where gpucomm cannot do what an
argument asks, the error says what to use instead. The object collectives live in
:mod:`gpucomm.distributed.objects`, the rest of torch.distributed's names in :mod:`gpucomm.distributed.torch_names`.

**One world with torch's.** gpucomm's default group *is* torch.distributed's: ``init_process_group``
here builds gpucomm's Communicator, then makes torch's default group of the ``gpucomm`` backend
around it (gpucomm.distributed.backend); ``torch.distributed.init_process_group("gpucomm")`` makes the same
thing from torch's side. Every group either API hands out is a torch ``ProcessGroup`` of that
backend (``group.WORLD``, ``new_group``, ``new_subgroups``, ``split_group``, a DeviceMesh's), which
DDP, FSDP2 and DTensor take and whose Communicator serves gpucomm's calls; so both APIs see the
same groups, ranks and collectives, in one order. A bare :class:`gpucomm.Communicator` is accepted
as a group too. gpucomm's calls find the default group's Communicator through one cached
reference, checked for ``closed`` (a destroy from torch's side closes it), so the hot path costs
what it did before.
"""

from __future__ import annotations

import atexit
import datetime
import inspect
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import GroupMember, group

from gpucomm.comm.communicator import Communicator, release_all
from gpucomm.comm.rendezvous import release_stores, rendezvous
from gpucomm.config import Config
from gpucomm.distributed.backend import BACKEND_NAME, Lent, Options
from gpucomm.errors import GpucommError, NotInitializedError, UnsupportedError
from gpucomm.reduce_op import ReduceOp
from gpucomm.reliability.story import NodeStatus
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
    "split_group",
    "shrink_group",
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

# torch.distributed's backend names, and what gpucomm serves each with: None = gpucomm's own
# paths (the workspace for CUDA tensors, gloo or GPUCOMM_TRANSPORT for CPU ones), "gloo" = every
# tensor of that device through gloo.
_DEVICE_BACKENDS = {"gpucomm": None, "nccl": None, "gloo": "gloo"}
_DEVICES = ("cpu", "cuda")
_NON_MEMBER = GroupMember.NON_GROUP_MEMBER  # torch's: an int (-100), compared with ==


class _State:
    # The Communicator of torch's default group, when that group is gpucomm's: a cache that
    # _world() checks (closed: torch destroyed it) and refills from torch's default group.
    # ``beside``: torch's default group was another backend's at init, and gpucomm's default
    # group stands beside it (``groups``: the subgroups made on it, closed with it).
    world: Communicator | None = None
    beside: bool = False
    groups: list[Communicator] = []


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
            raise ValueError(
                f"gpucomm.{fn}: backend {backend!r}: device maps look like 'cuda:nccl,cpu:gloo' with devices {list(_DEVICES)}"
            )
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
    device = (
        torch.device("cuda", device_id) if isinstance(device_id, int) and not isinstance(device_id, bool) else device_id
    )
    if not isinstance(device, torch.device):
        raise TypeError(f"gpucomm.{fn}: device_id must be a torch.device or an int, got {type(device_id).__name__}")
    if device.type != "cuda" or device.index is None:
        raise ValueError(
            f"gpucomm.{fn}: device_id must be a CUDA device with an index such as cuda:0, got {device}; CPU tensors need no device_id"
        )
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
    raise TypeError(
        f"gpucomm.{fn}: timeout must be a datetime.timedelta or a number of seconds, got {type(timeout).__name__}"
    )


def _knobs_of(pg_options: object, fn: str) -> dict[str, object]:
    if pg_options is None:
        return {}
    if not isinstance(pg_options, Options):
        raise TypeError(
            f"gpucomm.{fn}: pg_options must be a gpucomm.distributed.backend.Options (gpucomm's knobs), got "
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
        pg_options: a :class:`gpucomm.distributed.backend.Options` (knobs), as the ``gpucomm`` backend takes.
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
    if _current_world() is not None:
        raise GpucommError("gpucomm.init_process_group: already initialized; call destroy_process_group() first")
    if not isinstance(group_name, str):
        raise TypeError(f"gpucomm.{fn}: group_name must be a str, got {type(group_name).__name__}")
    transport = _transport_for(backend, fn)
    device = _device_for(device_id, fn)
    settings = {**_knobs_of(pg_options, fn), **knobs}
    if transport is not None:
        if settings.get("transport", transport) != transport:
            raise ValueError(
                f"gpucomm.{fn}: backend {backend!r} means transport={transport!r}, but transport={settings['transport']!r} was given too"
            )
        settings["transport"] = transport
    config = Config.from_env(timeout=_seconds(timeout, fn), **settings)
    rdv = rendezvous(
        init_method, None if rank == -1 else rank, None if world_size == -1 else world_size, store, config.timeout
    )
    comm = Communicator(
        rdv.store,
        rdv.rank,
        rdv.world_size,
        prefix=rdv.prefix,
        config=config,
        local_rank=rdv.local_rank,
        local_world_size=rdv.local_world_size,
        device=device,
    )
    if dist.is_initialized():
        # torch's default group is another backend's (the script initialized torch first, with
        # gloo or NCCL): torch keeps it, and gpucomm's default group stands beside it, as the
        # script asked; gpucomm's calls and groups are gpucomm's own (Communicators).
        _State.world, _State.beside, _State.groups = comm, True, []
        return
    lent = Lent(comm, Options(**{k: v for k, v in settings.items() if k in Options.__dataclass_fields__}))
    try:
        # torch's default group wraps this Communicator (gpucomm.distributed.backend.Lent), on the same store:
        # torch keys its groups under "default_pg/" there, gpucomm under its drawn prefix.
        # device_id stays with gpucomm (the group's bound_device_id stays None: gpucomm.distributed.backend).
        dist.init_process_group(
            BACKEND_NAME,
            store=rdv.store,
            rank=rdv.rank,
            world_size=rdv.world_size,
            timeout=datetime.timedelta(seconds=config.timeout),
            pg_options=lent,
        )
    except BaseException:
        comm.close()
        raise
    _State.world, _State.beside = comm, False


def destroy_process_group(group: object = None) -> None:
    """Destroy ``group``, or, when ``group`` is None (or the default group), every group and the
    default one: torch.distributed's world and gpucomm's are one, so this is torch's
    ``destroy_process_group`` too (and torch's destroys gpucomm's groups). A gpucomm default
    group beside torch's of another backend goes alone, with its subgroups."""
    if _is_non_member(group):
        return
    world = _current_world()
    if _State.beside and world is not None:
        if group is None or group is world:
            groups, _State.world, _State.groups, _State.beside = _State.groups, None, [], False
            for comm in groups:
                comm.close()
            world.close()
            return
        comm = _as_communicator(group, "destroy_process_group")
        comm.close()
        if comm in _State.groups:
            _State.groups.remove(comm)
        return
    if group is None or group is world or group is dist.group.WORLD:
        _State.world = None
        if dist.is_initialized():
            dist.destroy_process_group()
        if world is not None:
            world.close()  # closed already when torch's default group was its wrapper
        return
    if isinstance(group, Communicator):
        group.close()  # a Communicator made by the object API: not one of torch's groups
        return
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"gpucomm.destroy_process_group: group must be a process group or None, got {type(group).__name__}"
        )
    dist.destroy_process_group(group)


def _is_non_member(group: object) -> bool:
    return type(group) is int and group == _NON_MEMBER


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
    """Whether the default group exists and is gpucomm's (made by either API)."""
    return _current_world() is not None


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


def _current_world() -> Communicator | None:
    """The default group's Communicator, or None: the cached one while it is open, else the one
    of torch's default group when that is gpucomm's (``torch.distributed.init_process_group("gpucomm")``,
    or a re-init from torch's side)."""
    world = _State.world
    if world is not None and not world.closed:
        return world
    _State.world = None
    if dist.is_initialized():
        comm = getattr(dist.group.WORLD, "communicator", None)
        if isinstance(comm, Communicator) and not comm.closed:
            _State.world = comm
    return _State.world


def _world(fn: str) -> Communicator:
    world = _State.world
    if world is not None and not world.closed:  # the hot path: one load, one flag
        return world
    world = _current_world()
    if world is not None:
        return world
    if dist.is_initialized():
        raise NotInitializedError(
            f"gpucomm.{fn}: torch.distributed's default group has backend {dist.get_backend()!r}, not gpucomm's; "
            "initialize with gpucomm.init_process_group() or torch.distributed.init_process_group('gpucomm')"
        )
    raise NotInitializedError(f"gpucomm.{fn}: call gpucomm.init_process_group() first")


def _as_communicator(group: object, fn: str) -> Communicator:
    """A gpucomm group: a torch process group of the gpucomm backend, or a Communicator (and,
    beside torch's default group of another backend, that group: gpucomm's default one)."""
    comm = getattr(group, "communicator", None)
    if isinstance(comm, Communicator):
        return comm
    if isinstance(group, Communicator):
        return group
    if _State.beside and group is dist.group.WORLD and _State.world is not None:
        return _State.world
    if isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"gpucomm.{fn}: group is a torch process group of backend {_backend_name(group)!r}; gpucomm serves the groups "
            "of its own backend (gpucomm.new_group(), or torch.distributed.new_group() once the default group is gpucomm's)"
        )
    raise TypeError(
        f"gpucomm.{fn}: group must be a group from gpucomm.new_group() (or a torch process group of the "
        f"'gpucomm' backend) or None, got {type(group).__name__}"
    )


def _backend_name(group: dist.ProcessGroup) -> str:
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):
        return group.name()


def _group(group: object, fn: str) -> Communicator | None:
    """The communicator for ``group``; None (with torch.distributed's warning) outside it."""
    if group is None:
        return _world(fn)
    if _is_non_member(group):
        _world(fn)
        warnings.warn(f"gpucomm.{fn}: this rank is not part of the group; the call does nothing", stacklevel=3)
        return None
    return _as_communicator(group, fn)


def _group_rank(
    comm: Communicator, rank: int | None, group_rank: int | None, fn: str, name: str, default: int | None = 0
) -> int | None:
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
    """ "gpucomm", or "gloo" where ``backend="gloo"`` put every call of the job on gloo."""
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
        raise ValueError(
            f"gpucomm.get_group_rank: global rank {global_rank!r} is not part of the group (ranks {ranks})"
        )
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
    """A subgroup of the default group: a torch ``ProcessGroup`` of the gpucomm backend, which
    torch's components take (DDP's ``process_group=``, FSDP2, DTensor) and gpucomm's calls serve
    with its Communicator (a child of the default group's: same device, knobs, flight record).

    Every rank of the default group calls it, in the same order; with
    ``use_local_synchronization=True`` only the members do (torch's rule; others get None).
    ``timeout`` (a timedelta or seconds; default: the default group's) applies to the subgroup's
    calls; ``backend`` ("gloo", "nccl", "gpucomm", None) and ``pg_options`` (a
    :class:`gpucomm.distributed.backend.Options`) set its knobs; ``sort_ranks=False`` numbers its members in
    the order of ``ranks``. Returns ``GroupMember.NON_GROUP_MEMBER`` on the other ranks.
    """
    fn = "new_group"
    world = _world(fn)
    if device_id is not None and _device_for(device_id, fn) != world.device:
        raise ValueError(
            f"gpucomm.{fn}: device_id {device_id} differs from this rank's device {world.device}; subgroups use it"
        )
    seconds = _seconds(timeout, fn)
    if _State.beside:
        members = list(range(world.world_size)) if ranks is None else list(ranks)
        return _beside_group(
            world, members, seconds, _options_for(backend, pg_options, fn), use_local_synchronization, sort_ranks, fn
        )
    ordering = {}
    if not sort_ranks:  # torch 2.11's new_group has no sort_ranks (2.13's has): pass it only when asked
        if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
            raise UnsupportedError(
                f"gpucomm.{fn}: sort_ranks=False needs torch's new_group to take sort_ranks, and torch "
                f"{torch.__version__} has none; pass the ranks in ascending order, or use torch 2.13 or later"
            )
        ordering["sort_ranks"] = False
    return dist.new_group(
        ranks=None if ranks is None else list(ranks),
        timeout=None if seconds is None else datetime.timedelta(seconds=seconds),
        backend=BACKEND_NAME,
        pg_options=_options_for(backend, pg_options, fn),
        use_local_synchronization=use_local_synchronization,
        group_desc=group_desc,
        **ordering,
    )


def _beside_group(
    parent: Communicator,
    members: list[int],
    seconds: float | None,
    options: Options | None,
    local: bool,
    sort: bool,
    fn: str,
) -> object:
    """A subgroup of a gpucomm default group that stands beside torch's: a Communicator of its
    own (torch's world has no gpucomm group to register it under), made over ``parent``."""
    if local:
        raise UnsupportedError(
            f"gpucomm.{fn}: use_local_synchronization=True needs gpucomm's default group to be torch's; beside torch's "
            f"default group of another backend, gpucomm's groups are made by every rank of the parent (use_local_synchronization=False)"
        )
    outside = [r for r in members if r not in parent.global_ranks]
    if outside:
        raise ValueError(f"gpucomm.{fn}: rank(s) {outside} are not in the parent group (ranks {parent.global_ranks})")
    knobs = {} if options is None else options.knobs()
    comm = parent.new_subgroup([parent.global_ranks.index(r) for r in members], seconds, sort=sort, **knobs)
    if comm is None:
        return GroupMember.NON_GROUP_MEMBER
    _State.groups.append(comm)
    return comm


def _options_for(backend: str | None, pg_options: object, fn: str) -> Options | None:
    """The gpucomm backend's options for a group that a torch backend string and gpucomm's
    ``pg_options`` ask for (None: the default group's knobs)."""
    knobs = _knobs_of(pg_options, fn)
    transport = _transport_for(backend, fn)
    if transport is not None:
        knobs["transport"] = transport
    return Options(**knobs) if knobs else None  # type: ignore[arg-type]


def new_subgroups(
    group_size: int | None = None,
    group: object = None,
    timeout: datetime.timedelta | float | None = None,
    backend: str | None = None,
    pg_options: object = None,
    group_desc: str | None = None,
) -> tuple[object, list[object]]:
    """Split the default group (every rank calls it), or ``group`` (every member calls it), into
    consecutive subgroups of ``group_size`` ranks (default: the ranks of one node, where torch's
    default is the CUDA devices of one); returns this rank's subgroup and all of them
    (``GroupMember.NON_GROUP_MEMBER`` for those this rank is not in)."""
    fn = "new_subgroups"
    world = _world(fn)
    parent = world if group is None else _as_communicator(group, fn)
    size = parent.local_world_size if group_size is None else group_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or parent.world_size % size:
        raise ValueError(
            f"gpucomm.{fn}: group_size must be a positive divisor of the group's size {parent.world_size}, got {group_size!r}"
        )
    ranks = parent.global_ranks
    lists = [ranks[i : i + size] for i in range(0, len(ranks), size)]
    return _subgroups(parent, lists, timeout, backend, pg_options, group_desc, parent is not world, fn)


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
    if not ranks_per_subgroup_list:
        raise ValueError(f"gpucomm.{fn}: ranks_per_subgroup_list cannot be empty")
    return _subgroups(
        _world(fn), [list(r) for r in ranks_per_subgroup_list], timeout, backend, pg_options, group_desc, False, fn
    )


def _subgroups(
    parent: Communicator,
    lists: list[list[int]],
    timeout: object,
    backend: str | None,
    pg_options: object,
    group_desc: str | None,
    local: bool,
    fn: str,
) -> tuple[object, list[object]]:
    """One group per list of global ranks of ``parent``: made by every rank of the default group,
    or (``local``) by the members of each list only, which is what lets a subgroup's members
    split it without the other ranks."""
    seen: set[int] = set()
    for ranks in lists:
        outside = set(ranks) - set(parent.global_ranks)
        if outside:
            raise ValueError(
                f"gpucomm.{fn}: rank(s) {sorted(outside)} are not in the parent group (ranks {parent.global_ranks})"
            )
        if seen & set(ranks):
            raise ValueError(f"gpucomm.{fn}: rank(s) {sorted(seen & set(ranks))} appear in more than one subgroup")
        seen |= set(ranks)
    me = parent.global_ranks[parent.rank]
    mine: object = None
    groups: list[object] = []
    for ranks in lists:
        if _State.beside:  # collective over the parent, every list: Communicators of its own
            made = _beside_group(
                parent, ranks, _seconds(timeout, fn), _options_for(backend, pg_options, fn), False, True, fn
            )
        elif local and me not in ranks:
            groups.append(GroupMember.NON_GROUP_MEMBER)
            continue
        else:
            made = new_group(
                ranks, timeout, backend, pg_options, use_local_synchronization=local, group_desc=group_desc
            )
        groups.append(made)
        if me in ranks:
            mine = made
    return mine, groups


def split_group(
    parent_pg: object = None,
    split_ranks: list | None = None,
    timeout: datetime.timedelta | None = None,
    pg_options: object = None,
    group_desc: str | None = None,
    backend: str | None = None,
) -> object:
    """torch's ``split_group`` on gpucomm's groups: every member of ``parent_pg`` (default: the
    default group) calls it with the same ``split_ranks``, disjoint lists of *group* ranks of the
    parent; returns the group of the list this rank is in, None if it is in none.

    torch splits only NCCL communicators (``ncclCommSplit``); gpucomm makes each list's group as
    a child of the default group's Communicator: with every rank when the parent is the default
    group, else with the list's members alone, under torch's hashed name (the list's ranks and
    the number of groups the rank knows: the members must have made the same groups so far, as
    with torch's own split). ``backend`` and ``pg_options`` set its knobs as for :func:`new_group`.
    """
    fn = "split_group"
    parent = _world(fn) if parent_pg is None else _as_communicator(parent_pg, fn)
    if not split_ranks or not all(isinstance(r, (list, tuple)) for r in split_ranks):
        raise ValueError(
            f"gpucomm.{fn}: split_ranks must be a non-empty list of lists of group ranks, got {split_ranks!r}"
        )
    seen: set[int] = set()
    for ranks in split_ranks:
        if not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"gpucomm.{fn}: each split must be non-empty, without duplicates, got {list(ranks)}")
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < parent.world_size]
        if bad:
            raise ValueError(
                f"gpucomm.{fn}: split ranks are group ranks of the parent, in [0, {parent.world_size}), got {bad}"
            )
        if seen & set(ranks):
            raise ValueError(f"gpucomm.{fn}: group rank(s) {sorted(seen & set(ranks))} appear in more than one split")
        seen |= set(ranks)
    if _State.beside:  # every member of the parent makes every split's group, over the parent
        made = [
            _beside_group(
                parent,
                [parent.global_ranks[r] for r in ranks],
                _seconds(timeout, fn),
                _options_for(backend, pg_options, fn),
                False,
                True,
                fn,
            )
            for ranks in split_ranks
        ]
        return next((g for g in made if isinstance(g, Communicator)), None)
    world = _world(fn)
    if parent is world:
        # Every rank makes every split, in order, under torch's sequential names; a hashed name
        # (torch's for groups made by their members alone) counts the groups each rank knows,
        # which differ between ranks as soon as one is outside some group.
        made = [
            new_group([parent.global_ranks[r] for r in ranks], timeout, backend, pg_options, group_desc=group_desc)
            for ranks in split_ranks
        ]
        return next((g for g, ranks in zip(made, split_ranks) if parent.rank in ranks), None)
    mine = next((sorted(ranks) for ranks in split_ranks if parent.rank in ranks), None)
    if mine is None:
        return None
    members = [parent.global_ranks[r] for r in mine]
    return new_group(members, timeout, backend, pg_options, use_local_synchronization=True, group_desc=group_desc)


def shrink_group(
    ranks_to_exclude: list[int], group: object = None, shrink_flags: int = 0, pg_options: object = None
) -> object:
    """torch's ``shrink_group`` on a gpucomm subgroup: a new group of ``group``'s members but
    ``ranks_to_exclude`` (group ranks). Only the remaining members call it, as in torch.

    ``shrink_flags``: torch's ``SHRINK_DEFAULT`` (0) or ``SHRINK_ABORT`` (1); gpucomm has nothing
    to abort first (a collective stuck on an excluded rank ends by its timeout), so both make
    the group the same way. The default group cannot be shrunk yet (torch replaces it, and every
    other group, with NCCL's shrunk communicator): destroy_process_group() and init again with
    the remaining ranks.
    """
    fn = "shrink_group"
    world = _world(fn)
    parent = world if group is None else _as_communicator(group, fn)
    if parent is world:
        raise UnsupportedError(
            f"gpucomm.{fn}: the default group cannot be shrunk (torch replaces it and destroys every other group); "
            "shrink a subgroup, or destroy_process_group() and init again with the remaining ranks"
        )
    if shrink_flags not in (0, 1):
        raise ValueError(
            f"gpucomm.{fn}: shrink_flags must be SHRINK_DEFAULT (0) or SHRINK_ABORT (1), got {shrink_flags!r}"
        )
    if (
        not isinstance(ranks_to_exclude, list)
        or not ranks_to_exclude
        or len(set(ranks_to_exclude)) != len(ranks_to_exclude)
    ):
        raise ValueError(
            f"gpucomm.{fn}: ranks_to_exclude must be a non-empty list of distinct group ranks, got {ranks_to_exclude!r}"
        )
    bad = [
        r for r in ranks_to_exclude if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < parent.world_size
    ]
    if bad:
        raise ValueError(f"gpucomm.{fn}: ranks_to_exclude are group ranks in [0, {parent.world_size}), got {bad}")
    if parent.rank in ranks_to_exclude:
        raise RuntimeError(
            f"gpucomm.{fn}: group rank {parent.rank} is excluded and must not call shrink_group (torch's rule)"
        )
    if len(ranks_to_exclude) == parent.world_size:
        raise ValueError(f"gpucomm.{fn}: ranks_to_exclude leaves no rank of the group's {parent.world_size}")
    members = [g for r, g in enumerate(parent.global_ranks) if r not in ranks_to_exclude]
    if _State.beside:
        raise UnsupportedError(
            f"gpucomm.{fn}: shrinking needs gpucomm's default group to be torch's (the remaining ranks make the new group "
            "alone); beside torch's default group of another backend, make it with new_group on every rank"
        )
    if pg_options is None:  # torch's rule: the new group inherits the parent's options
        pg_options = Options(**{name: getattr(parent.config, name) for name in Options.__dataclass_fields__})
    timeout = datetime.timedelta(seconds=parent.timeout)
    # The parent's order kept; sorting a sorted list changes nothing (and torch 2.11 cannot skip it).
    return new_group(
        members, timeout, None, pg_options, use_local_synchronization=True, sort_ranks=members == sorted(members)
    )


# -- collectives ------------------------------------------------------------------------------
def all_reduce(
    tensor: torch.Tensor, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False
) -> Work | None:
    """Reduce ``tensor`` over the group, in place, on every rank (torch.distributed's call).

    Deterministic by contract: an element's bits depend only on its inputs on every rank, its
    dtype and op, and the group's layout, never on the size, algorithm, channels, kernels or
    arrival order (rank order in the accumulation type, one rounding; see
    :meth:`gpucomm.Communicator.all_reduce`).
    """
    comm = _group(group, "all_reduce")
    return None if comm is None else comm.all_reduce(tensor, op, async_op)


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
    comm = _group(group, "reduce")
    if comm is None:
        return None
    return comm.reduce(tensor, _group_rank(comm, dst, group_dst, "reduce", "dst"), op, async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: object = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    comm = _group(group, "broadcast")
    if comm is None:
        return None
    return comm.broadcast(tensor, _group_rank(comm, src, group_src, "broadcast", "src"), async_op)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: object = None, async_op: bool = False
) -> Work | None:
    comm = _group(group, "all_gather")
    return None if comm is None else comm.all_gather(tensor_list, tensor, async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: object = None, async_op: bool = False
) -> Work | None:
    comm = _group(group, "all_gather_into_tensor")
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
    comm = _group(group, "gather")
    if comm is None:
        return None
    return comm.gather(tensor, gather_list, _group_rank(comm, dst, group_dst, "gather", "dst"), async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int | None = None,
    group: object = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    comm = _group(group, "scatter")
    if comm is None:
        return None
    return comm.scatter(tensor, scatter_list, _group_rank(comm, src, group_src, "scatter", "src"), async_op)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: object = ReduceOp.SUM,
    group: object = None,
    async_op: bool = False,
) -> Work | None:
    """``output`` on rank i = the reduction of every rank's ``input_list[i]``; deterministic by
    contract, with the bits :func:`all_reduce` gives (see :meth:`gpucomm.Communicator.all_reduce`)."""
    comm = _group(group, "reduce_scatter")
    return None if comm is None else comm.reduce_scatter(output, input_list, op, async_op)


def reduce_scatter_tensor(
    output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, group: object = None, async_op: bool = False
) -> Work | None:
    """``output`` on rank i = the reduction of chunk i of every rank's ``input``; deterministic by
    contract, with the bits :func:`all_reduce` gives (see :meth:`gpucomm.Communicator.all_reduce`)."""
    comm = _group(group, "reduce_scatter_tensor")
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
    comm = _group(group, "all_to_all")
    return None if comm is None else comm.all_to_all(output_tensor_list, input_tensor_list, async_op)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | None = None,
    input_split_sizes: Sequence[int] | None = None,
    group: object = None,
    async_op: bool = False,
) -> Work | None:
    comm = _group(group, "all_to_all_single")
    return (
        None if comm is None else comm.all_to_all_single(output, input, output_split_sizes, input_split_sizes, async_op)
    )


def send(
    tensor: torch.Tensor, dst: int | None = None, group: object = None, tag: int = 0, group_dst: int | None = None
) -> None:
    comm = _group(group, "send")
    if comm is not None:
        comm.send(tensor, _group_rank(comm, dst, group_dst, "send", "dst", default=None), tag)  # type: ignore[arg-type]


def recv(
    tensor: torch.Tensor, src: int | None = None, group: object = None, tag: int = 0, group_src: int | None = None
) -> int:
    comm = _group(group, "recv")
    if comm is None:
        return -1
    source = comm.recv(tensor, _group_rank(comm, src, group_src, "recv", "src", default=None), tag)
    return comm.global_ranks[source]


def isend(
    tensor: torch.Tensor, dst: int | None = None, group: object = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    comm = _group(group, "isend")
    if comm is None:
        return None
    return comm.isend(tensor, _group_rank(comm, dst, group_dst, "isend", "dst", default=None), tag)  # type: ignore[arg-type]


def irecv(
    tensor: torch.Tensor, src: int | None = None, group: object = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    comm = _group(group, "irecv")
    if comm is None:
        return None
    return comm.irecv(tensor, _group_rank(comm, src, group_src, "irecv", "src", default=None), tag)


def empty(
    *size: object, dtype: torch.dtype | None = None, device: object = None, group: object = None
) -> torch.Tensor | None:
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
    comm = _group(group, "monitored_barrier")
    if comm is not None:
        comm.monitored_barrier(_seconds(timeout, "monitored_barrier"), wait_all_ranks)


def all_reduce_coalesced(
    tensors: list[torch.Tensor], op: object = ReduceOp.SUM, group: object = None, async_op: bool = False
) -> Work | None:
    """:func:`all_reduce` of each tensor of ``tensors`` (same dtype), in order."""
    fn = "all_reduce_coalesced"
    comm = _group(group, fn)
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
    comm = _group(group, fn)
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
                f"gpucomm.{fn}: output_tensor_lists[{r}] must hold {len(inputs)} tensors (one per input), got {len(outs)}"
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
