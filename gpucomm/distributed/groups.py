"""Group construction on gpucomm's world: ``new_group``, ``new_subgroups``,
``new_subgroups_by_enumeration``, ``split_group`` and ``shrink_group``, with torch's signatures.

Each function checks its arguments, then hands the making to the world's mode
(:class:`gpucomm.distributed.lookup.WorldMode`): torch ``ProcessGroup``\\ s of the gpucomm backend
in one world with torch's (:mod:`gpucomm.distributed.one_world`), Communicators of their own
beside torch's default group of another backend (:mod:`gpucomm.distributed.beside_torch`).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
from torch.distributed import GroupMember, group

from gpucomm.comm.communicator import Communicator
from gpucomm.distributed.arguments import device_for, options_for, seconds_of
from gpucomm.distributed.backend import Options
from gpucomm.distributed.lookup import Current, as_communicator, world
from gpucomm.errors import UnsupportedError

__all__ = [
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "shrink_group",
    "group",
    "GroupMember",
]


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
    :class:`gpucomm.distributed.backend.Options`) set its knobs; ``sort_ranks=False`` numbers its
    members in the order of ``ranks``. Returns ``GroupMember.NON_GROUP_MEMBER`` on the other ranks.
    """
    fn = "new_group"
    default = world(fn)
    if device_id is not None and device_for(device_id, fn) != default.device:
        raise ValueError(
            f"gpucomm.{fn}: device_id {device_id} differs from this rank's device {default.device}; subgroups use it"
        )
    seconds = seconds_of(timeout, fn)
    options = options_for(backend, pg_options, fn)
    members = None if ranks is None else list(ranks)
    return Current.mode.new_group(
        default, members, seconds, options, use_local_synchronization, group_desc, sort_ranks, fn
    )


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
    default = world(fn)
    parent = default if group is None else as_communicator(group, fn)
    size = parent.local_world_size if group_size is None else group_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or parent.world_size % size:
        raise ValueError(
            f"gpucomm.{fn}: group_size must be a positive divisor of the group's size {parent.world_size}, "
            f"got {group_size!r}"
        )
    ranks = parent.global_ranks
    lists = [ranks[i : i + size] for i in range(0, len(ranks), size)]
    return _subgroups(parent, lists, timeout, backend, pg_options, group_desc, parent is not default, fn)


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
        world(fn), [list(r) for r in ranks_per_subgroup_list], timeout, backend, pg_options, group_desc, False, fn
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
    """One group per list of global ranks of ``parent``, and this rank's: made by every rank of
    the default group, or (``local``) by the members of each list only, which is what lets a
    subgroup's members split it without the other ranks."""
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
    seconds, options = seconds_of(timeout, fn), options_for(backend, pg_options, fn)
    made = Current.mode.groups(parent, lists, seconds, options, local, group_desc, fn)
    me = parent.global_ranks[parent.rank]
    return _mine(made, lists, me), made


def _mine(made: list[object], lists: Sequence[list[int]], me: int) -> object:
    """The group of the list that holds global rank ``me``; None if none does."""
    return next((g for g, ranks in zip(made, lists, strict=True) if me in ranks), None)


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
    parent = world(fn) if parent_pg is None else as_communicator(parent_pg, fn)
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
    # Every rank makes every split of the default group, in order, under torch's sequential names;
    # a hashed name (torch's for groups made by their members alone) counts the groups each rank
    # knows, which differ between ranks as soon as one is outside some group. A subgroup's splits
    # are made by their members alone.
    local = parent is not world(fn)
    seconds, options = seconds_of(timeout, fn), options_for(backend, pg_options, fn)
    lists = [[parent.global_ranks[r] for r in sorted(ranks)] for ranks in split_ranks]
    made = Current.mode.groups(parent, lists, seconds, options, local, group_desc, fn)
    return _mine(made, lists, parent.global_ranks[parent.rank])


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
    default = world(fn)
    parent = default if group is None else as_communicator(group, fn)
    if parent is default:
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
    if pg_options is None:  # torch's rule: the new group inherits the parent's options
        pg_options = Options(**{name: getattr(parent.config, name) for name in Options.__dataclass_fields__})
    options = options_for(None, pg_options, fn)
    # The parent's order kept; sorting a sorted list changes nothing (and torch 2.11 cannot skip it).
    return Current.mode.shrink(default, members, parent.timeout, options, members == sorted(members), fn)
