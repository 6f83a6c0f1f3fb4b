"""How a call finds its group's Communicator: the default group's (cached), a group that torch or
gpucomm handed out, or None on a rank outside the group.

:class:`Current` holds the default group's Communicator and the :class:`WorldMode` that makes
and destroys the world's groups; :mod:`gpucomm.distributed.world` sets both at init and clears
them at destroy. The hot path (:func:`world`) costs one load and one flag.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Protocol

import torch.distributed as dist
from torch.distributed import GroupMember

from gpucomm.comm.communicator import Communicator
from gpucomm.distributed.backend import Options
from gpucomm.distributed.one_world import ONE_WORLD
from gpucomm.errors import NotInitializedError

__all__ = [
    "Current",
    "WorldMode",
    "as_communicator",
    "current_world",
    "find",
    "group_rank",
    "is_non_member",
    "world",
]

_NON_MEMBER = GroupMember.NON_GROUP_MEMBER  # torch's: an int (-100), compared with ==


class WorldMode(Protocol):
    """How the world's groups are made, found and destroyed; chosen once, at init.

    :data:`gpucomm.distributed.one_world.ONE_WORLD`: gpucomm's default group is torch's, and
    every group is a torch ``ProcessGroup`` of the gpucomm backend.
    :class:`gpucomm.distributed.beside_torch.BesideTorch`: torch's default group is another
    backend's, and gpucomm's groups are Communicators of their own beside it.
    """

    def world_group(self, group: object) -> Communicator | None:
        """The Communicator a torch group that is not gpucomm's stands for here, or None."""
        ...

    def names_world(self, group: object, world: Communicator | None) -> bool:
        """Whether destroying ``group`` destroys the whole world (the default group and all)."""
        ...

    def destroy_world(self, world: Communicator | None) -> None:
        """Destroy the default group, every group made on it, and ``world`` itself."""
        ...

    def destroy_group(self, group: object) -> None:
        """Destroy one group that is not the default one."""
        ...

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
        """A subgroup of the default group ``world`` (ranks: global; None: every rank), or
        ``GroupMember.NON_GROUP_MEMBER`` on a rank outside it; :func:`gpucomm.new_group`'s contract."""
        ...

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
        """One group of ``parent`` per list of global ranks, in order (``NON_GROUP_MEMBER`` for
        those this rank is not in): made by every rank of the default group, or (``local``, where
        the mode allows it) by each list's members alone."""
        ...

    def shrink(
        self, world: Communicator, members: list[int], seconds: float, options: Options | None, sort: bool, fn: str
    ) -> object:
        """The group of ``members`` (global ranks of ``world``), made by those members alone."""
        ...


class Current:
    """The default group's Communicator, when that group is gpucomm's, and the world's mode.

    ``world`` is a cache that :func:`world` checks (closed: torch destroyed it) and
    :func:`current_world` refills from torch's default group.
    """

    world: Communicator | None = None
    mode: WorldMode = ONE_WORLD


def current_world() -> Communicator | None:
    """The default group's Communicator, or None: the cached one while it is open, else the one
    of torch's default group when that is gpucomm's (``torch.distributed.init_process_group("gpucomm")``,
    or a re-init from torch's side)."""
    cached = Current.world
    if cached is not None and not cached.closed:
        return cached
    Current.world, Current.mode = None, ONE_WORLD  # a closed world leaves no mode behind
    if dist.is_initialized():
        comm = getattr(dist.group.WORLD, "communicator", None)
        if isinstance(comm, Communicator) and not comm.closed:
            Current.world = comm
    return Current.world


def world(fn: str) -> Communicator:
    """The default group's Communicator; NotInitializedError naming ``fn`` where there is none."""
    cached = Current.world
    if cached is not None and not cached.closed:  # the hot path: one load, one flag
        return cached
    found = current_world()
    if found is not None:
        return found
    if dist.is_initialized():
        raise NotInitializedError(
            f"gpucomm.{fn}: torch.distributed's default group has backend {dist.get_backend()!r}, not gpucomm's; "
            "initialize with gpucomm.init_process_group() or torch.distributed.init_process_group('gpucomm')"
        )
    raise NotInitializedError(f"gpucomm.{fn}: call gpucomm.init_process_group() first")


def as_communicator(group: object, fn: str) -> Communicator:
    """A gpucomm group's Communicator: of a torch process group of the gpucomm backend, a
    Communicator itself, or what the world's mode makes of another torch group (beside torch's
    default group of another backend, that group stands for gpucomm's default one).

    Raises TypeError for any other group.
    """
    comm = getattr(group, "communicator", None)
    if isinstance(comm, Communicator):
        return comm
    if isinstance(group, Communicator):
        return group
    comm = Current.mode.world_group(group)
    if comm is not None:
        return comm
    if isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"gpucomm.{fn}: group is a torch process group of backend {_backend_name(group)!r}; gpucomm serves the "
            "groups of its own backend (gpucomm.new_group(), or torch.distributed.new_group() once the default "
            "group is gpucomm's)"
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


def is_non_member(group: object) -> bool:
    """Whether ``group`` is ``GroupMember.NON_GROUP_MEMBER``: what a rank outside a group holds."""
    return type(group) is int and group == _NON_MEMBER


def find(group: object, fn: str) -> Communicator | None:
    """The Communicator of ``group`` (None: the default group's); None, with torch.distributed's
    warning, on a rank outside it."""
    if group is None:
        return world(fn)
    if is_non_member(group):
        world(fn)
        warnings.warn(f"gpucomm.{fn}: this rank is not part of the group; the call does nothing", stacklevel=3)
        return None
    return as_communicator(group, fn)


def group_rank(
    comm: Communicator, rank: int | None, group_rank: int | None, fn: str, name: str, default: int | None = 0
) -> int | None:
    """torch.distributed's rule: ``src``/``dst`` are global ranks, ``group_src``/``group_dst``
    group ranks; returns the group rank (``default`` when neither is given)."""
    if rank is not None and group_rank is not None:
        raise ValueError(f"gpucomm.{fn}: pass {name} or group_{name}, not both")
    if group_rank is not None:
        return group_rank
    if rank is None:
        return default
    if rank not in comm.global_ranks:
        raise ValueError(f"gpucomm.{fn}: {name}={rank} is not a member of the group (ranks {comm.global_ranks})")
    return comm.global_ranks.index(rank)
