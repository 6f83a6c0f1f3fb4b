"""The node layout every member of a communicator must share before a workspace opens.

Members are laid out node-major: node = global rank // local_world_size (LOCAL_WORLD_SIZE, as
torchrun sets it, or GPUCOMM_LOCAL_WORLD_SIZE). Each rank learns the layout from its own
local_world_size, so ranks that were started with different ones (two torchrun agents with
different ``--nproc-per-node``) would each build other nodes, and wait for peers that never
come. Here every member publishes its value and rank 0 compares them: a difference is an
:class:`~gpucomm.errors.UnsupportedError` on every rank that names each rank's value.

Nodes of different sizes with one agreed value (5 ranks, 2 a node: nodes of 2, 2 and 1) have no
workspace layout: gloo serves every collective of that communicator, and rank 0 says so once.
"""

from __future__ import annotations

import datetime

from gpucomm import log
from gpucomm.errors import UnsupportedError
from gpucomm.roles import Group

__all__ = ["agree"]


def agree(comm: Group, transport: str, nodes: list[list[int]]) -> None:
    """Check that every member states the same ranks per node; collective (a few store round trips).

    Raises:
        UnsupportedError: members disagree (on every rank, naming each rank's value).
    """
    prefix = f"{comm.prefix}{transport}/node-size/"
    timeout = datetime.timedelta(seconds=comm.timeout)
    comm.store.set(f"{prefix}{comm.rank}", str(comm.local_world_size))
    # Rank 0 reads every value and writes the verdict, which every rank reads: O(W) reads in
    # all at init, where every rank reading every value would be O(W^2) on the store's host.
    if comm.rank == 0:
        keys = [f"{prefix}{r}" for r in range(comm.world_size)]
        comm.store.wait(keys, timeout)
        sizes = [int(value) for value in comm.store.multi_get(keys)]
        stated = ", ".join(f"rank {r}: {size}" for r, size in enumerate(sizes)) if len(set(sizes)) > 1 else ""
        comm.store.set(f"{prefix}verdict", stated)
    comm.store.wait([f"{prefix}verdict"], timeout)
    stated = comm.store.get(f"{prefix}verdict").decode()
    if stated:
        raise UnsupportedError(
            f"gpucomm: the ranks state different numbers of ranks per node (LOCAL_WORLD_SIZE, or "
            f"GPUCOMM_LOCAL_WORLD_SIZE where set): {stated}; nodes of different sizes are not supported: "
            f"start every node with the same --nproc-per-node, or set GPUCOMM_LOCAL_WORLD_SIZE on every rank"
        )
    counts = [len(node) for node in nodes]
    if len(set(counts)) > 1 and comm.rank == 0 and comm.config.transport == "auto":
        log.logger.warning(
            f"gpucomm: nodes of {counts} ranks (local_world_size={comm.local_world_size}, world {comm.world_size}): no "
            f"workspace layout serves nodes of different sizes; gloo serves every collective of this group"
        )
