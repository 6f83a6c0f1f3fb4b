"""The default world's lifecycle and what it answers: ``init_process_group``,
``destroy_process_group``, ``is_initialized``, ``get_rank``, ``get_world_size``, ...

Swapping ``import torch.distributed as dist`` for ``import gpucomm as dist`` keeps a script
working: same names, same signatures and positional order (``tests/distributed/test_signatures.py``
compares them with ``inspect.signature``), same rank conventions. Where gpucomm cannot do what an
argument asks, the error says what to use instead. Groups are made in
:mod:`gpucomm.distributed.groups`, the collectives are in :mod:`gpucomm.distributed.collectives`
and :mod:`gpucomm.distributed.objects`, torch.distributed's other names in
:mod:`gpucomm.distributed.torch_names`.

**One world with torch's.** gpucomm's default group *is* torch.distributed's: ``init_process_group``
here builds gpucomm's Communicator, then makes torch's default group of the ``gpucomm`` backend
around it (gpucomm.distributed.backend); ``torch.distributed.init_process_group("gpucomm")`` makes
the same thing from torch's side. Every group either API hands out is a torch ``ProcessGroup`` of
that backend (``group.WORLD``, ``new_group``, ``new_subgroups``, ``split_group``, a DeviceMesh's),
which DDP, FSDP2 and DTensor take and whose Communicator serves gpucomm's calls; so both APIs see
the same groups, ranks and collectives, in one order (:mod:`gpucomm.distributed.one_world`). A
bare :class:`gpucomm.Communicator` is accepted as a group too. gpucomm's calls find the default
group's Communicator through one cached reference, checked for ``closed`` (a destroy from torch's
side closes it), so the hot path costs what it did before (:mod:`gpucomm.distributed.lookup`).

Where torch's default group was another backend's at init, gpucomm's stands beside it
(:mod:`gpucomm.distributed.beside_torch`).
"""

from __future__ import annotations

import atexit
import datetime

import torch
import torch.distributed as dist

from gpucomm import log
from gpucomm.comm.communicator import Communicator, release_all
from gpucomm.comm.rendezvous import release_stores, rendezvous
from gpucomm.config import Config
from gpucomm.distributed.arguments import device_for, knobs_of, seconds_of, transport_for
from gpucomm.distributed.backend import BACKEND_NAME, Options
from gpucomm.distributed.beside_torch import BesideTorch
from gpucomm.distributed.lookup import Current, as_communicator, current_world, find, is_non_member, world
from gpucomm.distributed.one_world import ONE_WORLD
from gpucomm.distributed.registration import Lent
from gpucomm.errors import GpucommError
from gpucomm.reliability.story import NodeStatus

__all__ = [
    "init_process_group",
    "destroy_process_group",
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
    "get_process_group_ranks",
    "get_global_rank",
    "get_group_rank",
]


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

    Raises GpucommError if gpucomm's default group exists already, TypeError or ValueError for
    arguments gpucomm does not serve.

    Example::

        # torchrun --nproc-per-node 3 script.py
        import torch, gpucomm as dist
        dist.init_process_group()
        t = torch.ones(4) * dist.get_rank()
        dist.all_reduce(t)          # t == 0 + 1 + 2 on every rank
        dist.destroy_process_group()
    """
    fn = "init_process_group"
    if current_world() is not None:
        raise GpucommError("gpucomm.init_process_group: already initialized; call destroy_process_group() first")
    if not isinstance(group_name, str):
        raise TypeError(f"gpucomm.{fn}: group_name must be a str, got {type(group_name).__name__}")
    transport = transport_for(backend, fn)
    device = device_for(device_id, fn)
    settings = {**knobs_of(pg_options, fn), **knobs}
    if transport is not None:
        if settings.get("transport", transport) != transport:
            raise ValueError(
                f"gpucomm.{fn}: backend {backend!r} means transport={transport!r}, "
                f"but transport={settings['transport']!r} was given too"
            )
        settings["transport"] = transport
    config = Config.from_env(timeout=seconds_of(timeout, fn), **settings)
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
        fn=fn,
    )
    comm.backend_name = _backend_name(backend)
    if transport == "gloo" and rdv.rank == 0:
        # Any log level: a script from torch's tutorials passes "gloo" and would otherwise never
        # learn that gpucomm's own paths are off (docs/torch-integration.md).
        log.logger.warning(
            f"gpucomm: init_process_group(backend={backend!r}): every call goes through gloo (path=gloo), as with "
            "torch.distributed; pass backend=None, 'gpucomm' or 'nccl' for gpucomm's own paths (the shared-memory "
            "workspace for CPU tensors, CUDA IPC for CUDA tensors)"
        )
    if dist.is_initialized():
        # torch's default group is another backend's (the script initialized torch first, with
        # gloo or NCCL): torch keeps it, and gpucomm's default group stands beside it, as the
        # script asked; gpucomm's calls and groups are gpucomm's own (Communicators).
        Current.world, Current.mode = comm, BesideTorch(comm)
        return
    lent = Lent(comm, Options(**{k: v for k, v in settings.items() if k in Options.__dataclass_fields__}))
    try:
        # torch's default group wraps this Communicator (gpucomm.distributed.registration.Lent), on the
        # same store: torch keys its groups under "default_pg/" there, gpucomm under its drawn prefix.
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
    Current.world, Current.mode = comm, ONE_WORLD


def destroy_process_group(group: object = None) -> None:
    """Destroy ``group``, or, when ``group`` is None (or the default group), every group and the
    default one: torch.distributed's world and gpucomm's are one, so this is torch's
    ``destroy_process_group`` too (and torch's destroys gpucomm's groups). A gpucomm default
    group beside torch's of another backend goes alone, with its subgroups.

    Raises TypeError for a ``group`` that is no process group."""
    if is_non_member(group):
        return
    default = current_world()
    mode = Current.mode
    if mode.names_world(group, default):
        Current.world, Current.mode = None, ONE_WORLD
        mode.destroy_world(default)
        return
    mode.destroy_group(group)


@atexit.register
def _release_at_exit() -> None:
    """A process that never called destroy_process_group stops gpucomm's threads (gloo's, the
    stores') before the interpreter tears itself down, so that it exits cleanly."""
    Current.world, Current.mode = None, ONE_WORLD
    release_all()
    release_stores()


def is_available() -> bool:
    """gpucomm is always available where it imports."""
    return True


def is_initialized() -> bool:
    """Whether the default group exists and is gpucomm's (made by either API)."""
    return current_world() is not None


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
    return world("get_default_communicator")


def status(group: object = None) -> NodeStatus:
    """What every rank of this node is doing now, read from their flight records without
    sending anything (a rank stuck in a collective does not need to answer).

    ``str()`` of the result is a table: per rank, the call it is in (collective, call number,
    group, call site) and for how long, and the last call it completed and how long ago.
    ``GPUCOMM_STATUS_SIGNAL=SIGUSR1`` makes a rank print the same table when signalled.

    Example::

        print(gpucomm.status())          # or: kill -USR1 <pid of a rank>
    """
    comm = world("status") if group is None else as_communicator(group, "status")
    return comm.status()


def get_rank(group: object = None) -> int:
    """This rank within ``group`` (None: the default group); -1 outside it."""
    comm = find(group, "get_rank")
    return -1 if comm is None else comm.rank


def get_world_size(group: object = None) -> int:
    """The number of ranks of ``group`` (None: the default group); -1 outside it."""
    comm = find(group, "get_world_size")
    return -1 if comm is None else comm.world_size


def get_backend(group: object = None) -> str:
    """The backend string the group was made with, as torch's ``get_backend`` returns it: "nccl"
    where ``init_process_group("nccl")`` made the default group (gpucomm serves it, on a CPU host
    too), "gloo" where every call goes through gloo, a device map such as "cuda:nccl,cpu:gloo" as
    it was passed, else "gpucomm". torch's own ``torch.distributed.get_backend()`` says "gpucomm"
    for every such group: its process group is of that backend (README, "The backend string")."""
    comm = find(group, "get_backend")
    if comm is None:
        raise ValueError("gpucomm.get_backend: this rank is not part of the group")
    if comm.config.transport == "gloo":
        return "gloo"
    return getattr(comm, "backend_name", None) or BACKEND_NAME


def _backend_name(backend: str | None) -> str:
    """What get_backend() answers for the default group made with ``backend`` (checked already)."""
    return BACKEND_NAME if backend is None else backend.strip().lower().replace(" ", "")


def get_process_group_ranks(group: object) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order (None: the default group)."""
    comm = find(group, "get_process_group_ranks")
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
