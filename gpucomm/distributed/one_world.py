"""One world with torch's: gpucomm's default group *is* torch.distributed's, and every group is a
torch ``ProcessGroup`` of the gpucomm backend, registered with torch (what DDP, FSDP2 and DTensor
take), whose Communicator is a child of the default group's.

:data:`ONE_WORLD` is the :class:`gpucomm.distributed.lookup.WorldMode` of every world but one
that stands beside torch's default group of another backend
(:class:`gpucomm.distributed.beside_torch.BesideTorch`).
"""

from __future__ import annotations

import datetime
import inspect
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import GroupMember

from gpucomm.comm.communicator import Communicator
from gpucomm.distributed.backend import BACKEND_NAME, Options
from gpucomm.errors import UnsupportedError

__all__ = ["ONE_WORLD", "OneWorld"]


class OneWorld:
    """Groups made and destroyed through torch.distributed, under torch's names."""

    def world_group(self, group: object) -> Communicator | None:
        """None: a torch group of another backend is not gpucomm's in this world."""
        return None

    def names_world(self, group: object, world: Communicator | None) -> bool:
        return group is None or group is world or group is dist.group.WORLD

    def destroy_world(self, world: Communicator | None) -> None:
        """torch's ``destroy_process_group()``, which shuts every gpucomm group down, then ``world``."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if world is not None:
            world.close()  # closed already when torch's default group was its wrapper

    def destroy_group(self, group: object) -> None:
        if isinstance(group, Communicator):
            group.close()  # a Communicator made by the object API: not one of torch's groups
            return
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"gpucomm.destroy_process_group: group must be a process group or None, got {type(group).__name__}"
            )
        dist.destroy_process_group(group)

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
        """torch's ``new_group`` with the gpucomm backend and ``options``."""
        ordering = {}
        if not sort:  # torch 2.11's new_group has no sort_ranks (2.13's has): pass it only when asked
            if "sort_ranks" not in inspect.signature(dist.new_group).parameters:
                raise UnsupportedError(
                    f"gpucomm.{fn}: sort_ranks=False needs torch's new_group to take sort_ranks, and torch "
                    f"{torch.__version__} has none; pass the ranks in ascending order, or use torch 2.13 or later"
                )
            ordering["sort_ranks"] = False
        return dist.new_group(
            ranks=ranks,
            timeout=None if seconds is None else datetime.timedelta(seconds=seconds),
            backend=BACKEND_NAME,
            pg_options=options,
            use_local_synchronization=local,
            group_desc=desc,
            **ordering,
        )

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
        """Each list's group through torch's ``new_group``: with every rank of the default group,
        or (``local``) with the list's members alone, the others skipping it."""
        me = parent.global_ranks[parent.rank]
        return [
            GroupMember.NON_GROUP_MEMBER
            if local and me not in ranks
            else self.new_group(parent, ranks, seconds, options, local, desc, True, fn)
            for ranks in lists
        ]

    def shrink(
        self, world: Communicator, members: list[int], seconds: float, options: Options | None, sort: bool, fn: str
    ) -> object:
        """The remaining members' group, made by them alone (torch's hashed name)."""
        return self.new_group(world, members, seconds, options, True, None, sort, fn)


ONE_WORLD = OneWorld()
