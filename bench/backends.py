"""Backends under test: one adapter per engine, all with torch.distributed's call names.

gpucomm mirrors torch.distributed's module functions, so an adapter is only "which module, and
how to start and stop it": ``adapter.mod.all_reduce(...)`` is the same call for every backend.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["Backend", "BACKENDS", "DEFAULT_TIMEOUT_S", "gpucomm_api_available", "why_unavailable", "make_backend",
           "describe_gpucomm"]

BACKENDS = ("gpucomm", "gloo", "nccl")

# The torch backends' (and the bench's rendezvous store's) wait when --timeout is not given.
# gpucomm then keeps its own (GPUCOMM_TIMEOUT, else also 300 s), so that its variable still works.
DEFAULT_TIMEOUT_S = 300.0


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
        if device.type != "cuda":
            return "nccl needs CUDA tensors and this run is on CPU"
        if not dist.is_nccl_available():
            return "torch was built without NCCL"
        if local_world_size > torch.cuda.device_count():
            return (
                f"nccl needs one GPU per rank; {local_world_size} local ranks would share "
                f"{torch.cuda.device_count()} GPU(s)"
            )
        return None
    raise ValueError(f"why_unavailable: expected a backend in {BACKENDS}, got {name!r}")


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
            "ignore", message=r".*torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)`? is deprecated",
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
    """What serves gpucomm's calls, read from its started default communicator:
    ``{"paths": {"cpu": "workspace transport=shm kernels=torch"}, "config": {"transport": "auto", ...}}``
    (``paths`` as ``Communicator.paths()`` words it, ``config`` the knobs as gpucomm resolved them)."""
    comm = backend.mod.get_default_communicator()
    return {"paths": comm.paths(), "config": dataclasses.asdict(comm.config)}
