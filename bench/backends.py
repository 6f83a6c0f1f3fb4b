"""Backends under test: one adapter per engine, all with torch.distributed's call names.

gpucomm mirrors torch.distributed's module functions, so an adapter is only "which module, and
how to start and stop it": ``adapter.mod.all_reduce(...)`` is the same call for every backend.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "Backend",
    "BACKENDS",
    "DEFAULT_TIMEOUT_S",
    "NCCL_MULTI_RANK_ENV",
    "NCCL_MULTI_RANK_SINCE",
    "gpucomm_api_available",
    "why_unavailable",
    "nccl_version",
    "nccl_refusal",
    "nccl_shares_gpus",
    "nccl_spawn_env",
    "make_backend",
    "describe_gpucomm",
]

BACKENDS = ("gpucomm", "gloo", "nccl")

# The torch backends' (and the bench's rendezvous store's) wait when --timeout is not given.
# gpucomm then keeps its own (GPUCOMM_TIMEOUT, else also 300 s), so that its variable still works.
DEFAULT_TIMEOUT_S = 300.0

# NCCL refuses two ranks of one communicator on one GPU, unless (from NCCL 2.30) this variable is
# 1 in the rank's environment when NCCL initialises: then it runs in the layout gpucomm's ranks
# share one GPU in.
NCCL_MULTI_RANK_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
NCCL_MULTI_RANK_SINCE = (2, 30)


def gpucomm_api_available() -> bool:
    """Whether gpucomm's torch.distributed-style API exists in this install."""
    try:
        gpucomm = importlib.import_module("gpucomm")
    except ImportError:
        return False
    return hasattr(gpucomm, "all_reduce") and hasattr(gpucomm, "init_process_group")


def why_unavailable(name: str, device: torch.device, world_size: int, local_world_size: int) -> str | None:
    """None if ``name`` can run here, else the reason in words (printed in the report)."""
    if name == "gpucomm":
        return None if gpucomm_api_available() else "gpucomm's collective API is not in this install"
    if name == "gloo":
        return None if dist.is_gloo_available() else "torch was built without gloo"
    if name == "nccl":
        return nccl_refusal(
            device.type,
            dist.is_nccl_available(),
            nccl_version(),
            torch.cuda.device_count() if device.type == "cuda" else 0,
            local_world_size,
            os.environ.get(NCCL_MULTI_RANK_ENV),
        )
    raise ValueError(f"why_unavailable: expected a backend in {BACKENDS}, got {name!r}")


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL torch was built with, as ``(major, minor, patch)``; None where torch has none."""
    if not dist.is_nccl_available():
        return None
    version = torch.cuda.nccl.version()
    if isinstance(version, int):  # older torch: NCCL_VERSION_CODE, major * 10000 + minor * 100 + patch
        return (version // 10000, version // 100 % 100, version % 100)
    return tuple(version)


def _version_text(version: tuple[int, ...] | None) -> str:
    return "none" if version is None else ".".join(map(str, version))


def nccl_shares_gpus(version: tuple[int, ...] | None, gpus: int, local_world_size: int) -> bool:
    """Whether NCCL runs here with several ranks on one GPU.

    True where there are more local ranks than GPUs and an NCCL that accepts that (2.30 and later,
    with :data:`NCCL_MULTI_RANK_ENV` set).
    """
    return local_world_size > gpus >= 1 and version is not None and version[:2] >= NCCL_MULTI_RANK_SINCE


def nccl_refusal(
    device_type: str,
    nccl_built: bool,
    version: tuple[int, ...] | None,
    gpus: int,
    local_world_size: int,
    env_value: str | None,
) -> str | None:
    """Why NCCL cannot run in this layout, in words; None where it can.

    ``version`` is the installed NCCL's, ``env_value`` this rank's :data:`NCCL_MULTI_RANK_ENV`.
    """
    if device_type != "cuda":
        return "nccl needs CUDA tensors and this run is on CPU"
    if not nccl_built:
        return "torch was built without NCCL"
    if local_world_size <= gpus:
        return None
    shared = f"{local_world_size} local ranks would share {gpus} GPU(s)"
    if not nccl_shares_gpus(version, gpus, local_world_size):
        since = ".".join(map(str, NCCL_MULTI_RANK_SINCE))
        return (
            f"nccl: {shared}, and NCCL {_version_text(version)} takes one GPU per rank (several ranks on one "
            f"GPU from NCCL {since}, with {NCCL_MULTI_RANK_ENV}=1)"
        )
    if env_value != "1":
        return (
            f"nccl: {shared}: NCCL {_version_text(version)} accepts that with {NCCL_MULTI_RANK_ENV}=1 in the "
            f"ranks' environment before they start, and it is {env_value!r} here (gpucomm-bench sets it in the "
            "ranks it spawns; under torchrun, set it in torchrun's environment)"
        )
    return None


def nccl_spawn_env(backends: list[str], device_kind: str, nproc: int) -> dict[str, str]:
    """The environment NCCL needs in the ``nproc`` ranks about to be spawned; ``{}`` where none.

    On a host with fewer GPUs than ranks: :data:`NCCL_MULTI_RANK_ENV`, where the installed NCCL
    accepts it. ``{}`` where NCCL is not asked for, runs on a GPU per rank, or cannot share one (the
    ranks then say why). Set at spawn, not mid-run: NCCL reads it when it initialises.
    """
    if "nccl" not in backends or device_kind == "cpu" or not torch.cuda.is_available():
        return {}
    return {NCCL_MULTI_RANK_ENV: "1"} if nccl_shares_gpus(nccl_version(), torch.cuda.device_count(), nproc) else {}


@dataclass
class Backend:
    """A started backend: ``mod`` holds the collectives, ``op(name)`` the matching ReduceOp."""

    name: str
    mod: object
    knobs: dict[str, str] = field(default_factory=dict)

    def op(self, name: str) -> object:
        return getattr(self.mod.ReduceOp, _OP_NAMES[name])

    def close(self) -> None:
        self.mod.destroy_process_group()


_OP_NAMES = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "avg": "AVG"}


def make_backend(
    name: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    device: torch.device,
    knobs: dict[str, str],
    timeout_s: float | None,
) -> Backend:
    """Initialise ``name`` on ``store`` (a fresh prefix per backend) and return its adapter.

    ``knobs`` (transport, kernels, algo) apply to gpucomm only; the torch backends ignore them.
    gpucomm gets only the knobs given (and ``timeout_s`` only if given): for the rest it reads
    its ``GPUCOMM_*`` variables and its own defaults, as in any program that uses it.
    gpucomm's default group and torch.distributed's live side by side, each on its own prefix.
    """
    if name == "gpucomm":
        gpucomm = importlib.import_module("gpucomm")
        gpucomm.init_process_group(store=store, rank=rank, world_size=world_size, timeout=timeout_s, **knobs)
        return Backend(name, gpucomm, dict(knobs))
    if name in ("gloo", "nccl"):
        # torch >= 2.12 marks these two names deprecated; they are the names gpucomm mirrors and
        # the only ones older torch has, so the bench keeps them and silences the notice.
        warnings.filterwarnings(
            "ignore",
            message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`? is deprecated",
            category=FutureWarning,
        )
        extra = {"device_id": device} if name == "nccl" else {}
        dist.init_process_group(
            name,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S),
            **extra,
        )
        return Backend(name, dist)
    raise ValueError(f"make_backend: expected a backend in {BACKENDS}, got {name!r}")


def describe_gpucomm(backend: Backend) -> dict:
    """What serves gpucomm's calls, read from its started default communicator.

    ``{"paths": {"cpu": "workspace transport=shm kernels=torch"}, "config": {"transport": "auto", ...}}``:
    ``paths`` as ``Communicator.paths()`` words it, ``config`` the knobs as gpucomm resolved them.
    """
    comm = backend.mod.get_default_communicator()
    return {"paths": comm.paths(), "config": dataclasses.asdict(comm.config)}
