"""gpucomm's default group beside torch's of another backend: the script initialized
torch.distributed first (with gloo or NCCL), then gpucomm. torch keeps its default group;
gpucomm's calls and groups are gpucomm's own Communicators, which torch's world has no gpucomm
group to register under.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch.distributed import GroupMember

from gpucomm.comm.communicator import Communicator
from gpucomm.distributed.backend import Options
from gpucomm.distributed.lookup import as_communicator
from gpucomm.errors import UnsupportedError

__all__ = ["BesideTorch"]


class BesideTorch:
    """The :class:`gpucomm.distributed.lookup.WorldMode` of a gpucomm default group ``world``
    that stands beside torch's: its groups are Communicators made over a parent by every rank
    of that parent, kept in ``groups_made`` to be closed with ``world``; torch's ``group.WORLD``
    stands for ``world``."""

    def __init__(self, world: Communicator) -> None:
        self.world = world
        self.groups_made: list[Communicator] = []

    def world_group(self, group: object) -> Communicator | None:
        """``world`` for torch's ``group.WORLD`` (another backend's group: gpucomm's default here)."""
        return self.world if group is dist.group.WORLD else None

    def names_world(self, group: object, world: Communicator | None) -> bool:
        return group is None or group is world

    def destroy_world(self, world: Communicator | None) -> None:
        """Close every group made beside torch, then ``world``; torch's default group stays."""
        groups, self.groups_made = self.groups_made, []
        for comm in groups:
            comm.close()
        self.world.close()

    def destroy_group(self, group: object) -> None:
        comm = as_communicator(group, "destroy_process_group")
        comm.close()
        if comm in self.groups_made:
            self.groups_made.remove(comm)

    def new_group(
        self,
        world: Communicator,
        ranks: list[int] | None,
        seconds: float | None,
        options: Options | None,
        local: bool,
        desc: str | None,
        sort: bool,
        fn: str,
    ) -> object:
        """A Communicator over ``world`` (``desc`` has no torch group to describe)."""
        members = list(range(world.world_size)) if ranks is None else ranks
        return self._group(world, members, seconds, options, local, sort, fn)

    def groups(
        self,
        parent: Communicator,
        lists: Sequence[list[int]],
        seconds: float | None,
        options: Options | None,
        local: bool,
        desc: str | None,
        fn: str,
    ) -> list[object]:
        """Every list's group, made by every rank of ``parent`` (collective over it, whatever ``local``)."""
        return [self._group(parent, ranks, seconds, options, False, True, fn) for ranks in lists]

    def shrink(
        self, world: Communicator, members: list[int], seconds: float, options: Options | None, sort: bool, fn: str
    ) -> object:
        """Refused: a group made by the remaining ranks alone needs torch's world."""
        raise UnsupportedError(
            f"gpucomm.{fn}: shrinking needs gpucomm's default group to be torch's (the remaining ranks make the new "
            "group alone); beside torch's default group of another backend, make it with new_group on every rank"
        )

    def _group(
        self,
        parent: Communicator,
        members: list[int],
        seconds: float | None,
        options: Options | None,
        local: bool,
        sort: bool,
        fn: str,
    ) -> object:
        """A subgroup of ``parent`` of the global ranks ``members``: a Communicator of its own, or
        ``GroupMember.NON_GROUP_MEMBER`` on the other ranks of ``parent``."""
        if local:
            raise UnsupportedError(
                f"gpucomm.{fn}: use_local_synchronization=True needs gpucomm's default group to be torch's; beside "
                "torch's default group of another backend, gpucomm's groups are made by every rank of the parent "
                "(use_local_synchronization=False)"
            )
        outside = [r for r in members if r not in parent.global_ranks]
        if outside:
            raise ValueError(
                f"gpucomm.{fn}: rank(s) {outside} are not in the parent group (ranks {parent.global_ranks})"
            )
        knobs = {} if options is None else options.knobs()
        comm = parent.new_subgroup([parent.global_ranks.index(r) for r in members], seconds, sort=sort, fn=fn, **knobs)
        if comm is None:
            return GroupMember.NON_GROUP_MEMBER
        self.groups_made.append(comm)
        return comm
