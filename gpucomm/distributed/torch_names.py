"""The rest of torch.distributed's public names, so that ``import gpucomm as dist`` leaves no
name of a torch.distributed script behind (tests/distributed/test_torch_names.py walks torch's list).

Two kinds, by one rule: where gpucomm adds nothing, the name is torch's own object (the error
classes, so that ``except dist.DistBackendError`` catches gpucomm's too; the option structs;
``GradBucket`` for DDP comm hooks; ``DeviceMesh``, whose groups are gpucomm's once the default
group is; ...). Where a call makes, finds or describes groups and backends, it is gpucomm's, with
torch's signature: those below, and ``split_group``/``shrink_group`` in :mod:`gpucomm.distributed.groups`.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist
from torch.distributed import DeviceMesh  # also one of torch's own below; the annotation of init_device_mesh
from torch.distributed import rendezvous as rendezvous  # torch's function; gpucomm.comm.rendezvous keeps its path

from gpucomm.distributed.backend import BACKEND_NAME
from gpucomm.distributed.collectives import monitored_barrier
from gpucomm.distributed.world import (
    get_backend,
    get_default_communicator,
    get_rank,
    init_process_group,
    is_gloo_available,
    is_initialized,
    is_nccl_available,
)

# torch's own objects, where this torch has them: the list follows torch 2.13's, and an older
# torch lacks some (2.11, on the lent GPU image, has no ``record_comm``). A name torch lacks is
# one gpucomm lacks too, as under ``import torch.distributed as dist``.
_TORCH_OWN = (
    "AllreduceCoalescedOptions",
    "AllreduceOptions",
    "AllToAllOptions",
    "Backend",
    "BackendConfig",
    "BarrierOptions",
    "BroadcastOptions",
    "BuiltinCommHookType",
    "DebugLevel",
    "DeviceMesh",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "FileStore",
    "GatherOptions",
    "GradBucket",
    "GroupName",
    "HashStore",
    "Logger",
    "PrefixStore",
    "ProcessGroup",
    "ProcessGroupGloo",
    "ProcessGroupNCCL",  # CUDA builds of torch only
    "QueueEmptyError",
    "RankType",
    "ReduceOptions",
    "ReduceScatterOptions",
    "Reducer",
    "ScatterOptions",
    "Store",
    "TCPStore",
    "default_pg_timeout",
    "get_debug_level",
    "get_pg_count",
    "record_comm",
    "register_rendezvous_handler",
    "set_debug_level",
    "set_debug_level_from_env",
    "timedelta",
)
globals().update({name: getattr(dist, name) for name in _TORCH_OWN if hasattr(dist, name)})
__all__ = [
    # torch's own objects
    *(name for name in _TORCH_OWN if hasattr(dist, name)),
    "rendezvous",
    # gpucomm's, with torch's signatures
    "breakpoint",
    "get_backend_config",
    "get_default_backend_for_device",
    "get_node_local_rank",
    "init_device_mesh",
    "is_backend_available",
    "is_mpi_available",
    "is_ucc_available",
    "is_xccl_available",
]

# The devices gpucomm serves, and the backends gpucomm.init_process_group takes.
_DEVICES = ("cpu", "cuda")
_BACKENDS = ("gpucomm", "nccl", "gloo")


def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
    backend_override: dict | None = None,
) -> DeviceMesh:
    """torch's ``init_device_mesh`` on gpucomm's world: every dimension's groups are gpucomm
    groups (children of the default group's Communicator). Where no default group exists it
    calls :func:`gpucomm.init_process_group` first (torch's would make a gloo or NCCL one).

    ``backend_override`` is torch's: a dimension given a torch backend ("gloo") gets torch's.

    Example::

        mesh = gpucomm.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        gpucomm.all_reduce(t, group=mesh.get_group("tp"))
    """
    if not is_initialized():
        if dist.is_initialized():
            get_default_communicator()  # raises: the default group is another backend's
        init_process_group()
    return dist.init_device_mesh(
        device_type, mesh_shape, mesh_dim_names=mesh_dim_names, backend_override=backend_override
    )


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its node: ``LOCAL_RANK`` as torch reads it; without it, the local
    rank gpucomm's default group found at init (``rank % LOCAL_WORLD_SIZE``); then
    ``fallback_rank``; else RuntimeError, as torch's."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if is_initialized():
        return get_default_communicator().local_rank
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        "gpucomm.get_node_local_rank: LOCAL_RANK is not set, no default group exists and no fallback_rank was given; "
        "launch with torchrun (or set LOCAL_RANK), or call gpucomm.init_process_group() first"
    )


def is_backend_available(backend: str) -> bool:
    """Whether :func:`gpucomm.init_process_group` serves ``backend`` on this host: "gpucomm"
    always; "nccl" where CUDA is (gpucomm's CUDA workspace serves it); "gloo" where torch has
    gloo; device maps when each of their backends is; "mpi", "ucc", "xccl" never."""
    if not isinstance(backend, str):
        raise TypeError(f"gpucomm.is_backend_available: backend must be a str, got {type(backend).__name__}")
    names = [item.split(":", 1)[-1].strip().lower() for item in backend.split(",")]
    return all(_available(name) for name in names)


def _available(name: str) -> bool:
    if name == BACKEND_NAME:
        return True
    if name == "nccl":
        return is_nccl_available()
    if name == "gloo":
        return is_gloo_available()
    return False


def is_mpi_available() -> bool:
    """False: gpucomm serves no "mpi" backend (init_process_group("mpi") is refused)."""
    return False


def is_ucc_available() -> bool:
    """False: gpucomm serves no "ucc" backend."""
    return False


def is_xccl_available() -> bool:
    """False: gpucomm serves no "xccl" backend (Intel GPUs)."""
    return False


def get_default_backend_for_device(device: str | torch.device) -> str:
    """The backend gpucomm serves ``device`` with: "gpucomm" for "cpu" and "cuda" (where torch
    names gloo and NCCL); ValueError for devices gpucomm does not serve."""
    kind = torch.device(device).type
    if kind not in _DEVICES:
        raise ValueError(
            f"gpucomm.get_default_backend_for_device: gpucomm serves {list(_DEVICES)}, got device type {kind!r}"
        )
    return BACKEND_NAME


def get_backend_config(group: object = None) -> str:
    """The backend of each device of ``group`` in torch's form, ``"cpu:gpucomm,cuda:gpucomm"``
    (``gloo`` where the group's knobs put every call on gloo)."""
    name = get_backend(group)
    return ",".join(f"{device}:{name}" for device in _DEVICES)


_breakpoints_seen: dict[int, int] = {}


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float | None = 3600) -> None:  # noqa: A001 (torch's name)
    """torch's ``breakpoint`` on gpucomm's default group: ``rank`` stops in pdb (reading the
    terminal, as torch's does), the others wait in a barrier of ``timeout_s`` seconds (a
    monitored barrier: gpucomm's groups keep the timeout they were made with, which a debug
    session may outlast). ``skip``: let the first ``skip`` calls from this place go by."""
    if skip > 0:
        key = hash("".join(traceback.format_stack()[:-1]))
        _breakpoints_seen[key] = _breakpoints_seen.get(key, 0) + 1
        if _breakpoints_seen[key] <= skip:
            return
    if get_rank() == rank:
        from torch.distributed import _make_distributed_pdb  # torch's pdb that reads the terminal

        pdb = _make_distributed_pdb()
        pdb.message(
            f"\n!!! ATTENTION !!!\n\nType 'up' to get to the frame that called gpucomm.breakpoint(rank={rank})\n"
        )
        pdb.set_trace()
    monitored_barrier(timeout=None if timeout_s is None else float(timeout_s))
