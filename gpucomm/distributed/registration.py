"""Registration of the ``gpucomm`` backend with torch.distributed, and the creator torch calls
for each group of it: importing gpucomm registers it, so that
``torch.distributed.init_process_group("gpucomm")`` and ``new_group(backend="gpucomm")`` build
a :class:`gpucomm.distributed.backend.ProcessGroupGpucomm`.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from gpucomm.comm.communicator import Communicator
from gpucomm.comm.rendezvous import rendezvous
from gpucomm.config import Config, check_timeout
from gpucomm.distributed.backend import BACKEND_NAME, Options, ProcessGroupGpucomm

__all__ = ["Lent"]


class Lent:
    """``pg_options`` by which :func:`gpucomm.init_process_group` hands torch the Communicator it
    built (its own rendezvous, knobs and device), so that torch's default group wraps it instead
    of building another: one world for both APIs."""

    def __init__(self, communicator: Communicator, options: Options) -> None:
        self.communicator = communicator
        self.options = options


def _create(options: object, backend_options: object = None) -> ProcessGroupGpucomm:
    """torch's creator (``extended_api=True``): a ``_DistributedBackendOptions`` with the group's
    store (already prefixed with its group name), rank, size, timeout, name (``group_id``) and
    global ranks; ``backend_options`` is what the caller passed as ``pg_options``.

    Three cases: the default group of ``gpucomm.init_process_group`` (a :class:`Lent`
    Communicator, wrapped as it is); a subgroup of a gpucomm default group (a child of its
    Communicator: the same device, node layout, knobs and flight record); any other group
    (torch's default group of ``init_process_group("gpucomm")``, or a gpucomm group beside a
    default group of another backend: a Communicator of its own)."""
    rank, size = options.group_rank, options.group_size  # type: ignore[attr-defined]
    name = str(options.group_id)  # type: ignore[attr-defined]
    if isinstance(backend_options, Lent):
        comm = backend_options.communicator
        if (comm.rank, comm.world_size) != (rank, size):
            raise ValueError(
                f"gpucomm backend: the lent communicator is rank {comm.rank} of {comm.world_size}, "
                f"torch asked for rank {rank} of {size}"
            )
        return ProcessGroupGpucomm(comm, name, backend_options.options)
    if backend_options is not None and not isinstance(backend_options, Options):
        raise TypeError(
            "gpucomm backend: pg_options must be a gpucomm.distributed.backend.Options, "
            f"got {type(backend_options).__name__}"
        )
    pg_options = backend_options if backend_options is not None else Options()
    global_ranks = list(options.global_ranks_in_group) or list(range(size))  # type: ignore[attr-defined]
    fn = "new_group(backend='gpucomm')" if options.global_ranks_in_group else "init_process_group(backend='gpucomm')"  # type: ignore[attr-defined]
    parent = _default_communicator() if options.global_ranks_in_group else None  # type: ignore[attr-defined]
    # torch always passes a timeout (its default, 30 min, when the caller gave none): a subgroup
    # given none keeps its parent's, as gpucomm's do; elsewhere an explicit GPUCOMM_TIMEOUT wins.
    given = options.timeout  # type: ignore[attr-defined]
    if given == dist.default_pg_timeout if parent is not None else os.environ.get("GPUCOMM_TIMEOUT"):
        given = None
    seconds = None if given is None else check_timeout(given, fn)
    if parent is not None:
        # rendezvous draws a fresh key prefix in this group's store (torch prefixed it with the
        # group's name, which every member agreed on), so that a group re-created on a reused
        # store never reads the previous generation's workspace handles. The group's timeout
        # bounds its making too, as torch's does.
        timeout = parent.timeout if seconds is None else seconds
        rdv = rendezvous(None, rank, size, options.store, timeout, fn=fn, global_ranks=global_ranks)  # type: ignore[attr-defined]
        comm = parent.subgroup(rdv.store, rdv.prefix, rank, global_ranks, seconds, fn, **pg_options.knobs())
        return ProcessGroupGpucomm(comm, name, pg_options)
    config = Config.from_env(timeout=seconds, **pg_options.knobs())
    named = global_ranks if options.global_ranks_in_group else None  # type: ignore[attr-defined]
    rdv = rendezvous(None, rank, size, options.store, config.timeout, fn=fn, global_ranks=named)  # type: ignore[attr-defined]
    comm = Communicator(
        rdv.store,
        rank,
        size,
        prefix=rdv.prefix,
        config=config,
        local_rank=rdv.local_rank,
        local_world_size=min(rdv.local_world_size, size),
        global_ranks=global_ranks,
        fn=fn,
    )
    return ProcessGroupGpucomm(comm, name, pg_options)


def _default_communicator() -> Communicator | None:
    """The Communicator of torch's default group, where that group is gpucomm's."""
    world = dist.group.WORLD if dist.is_initialized() else None
    comm = getattr(world, "communicator", None)
    return comm if isinstance(comm, Communicator) and not comm.closed else None


def _register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


_register()
