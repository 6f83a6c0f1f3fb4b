"""A timeout while a group is being made names the call, the group and the ranks it waited for,
in group and global numbering, as a CommTimeoutError (before: a raw DistStoreError naming a gloo
store key, or ``init_process_group: rank 1`` for a subgroup, with group ranks read as global)."""

from __future__ import annotations

import datetime
import time

from checks import outcome as _outcome
from rank_store import rank_store, store_barrier
from spawn import run_ranks


def _init_without_rank_1(rank: int, world_size: int) -> str:
    import gpucomm

    if rank == 1:
        return "absent"
    return _outcome(lambda: gpucomm.init_process_group(backend="gloo", timeout=2))


def test_init_timeout_names_the_call_the_group_and_the_missing_rank() -> None:
    results = run_ranks(_init_without_rank_1, 2, timeout=60)
    assert results[0] == (
        "NeverJoinedError: gpucomm.init_process_group: rank 1 never joined (1 of 2 arrived after 2 s); start every "
        "rank, or check WORLD_SIZE and each rank's RANK"
    ), results


def _gloo_stalls_on_rank_1(rank: int, world_size: int) -> str:
    import gpucomm
    from gpucomm.comm import communicator

    if rank == 1:

        def stalled(*args: object, **kwargs: object) -> None:
            time.sleep(4)  # arrived, but never connects gloo within rank 0's timeout
            raise RuntimeError("rank 1 stalled before gloo")

        communicator.GlooFallback = stalled
    return _outcome(lambda: gpucomm.init_process_group(backend="gloo", timeout=2))


def test_a_gloo_connect_timeout_at_init_is_a_comm_timeout_error_naming_the_call() -> None:
    results = run_ranks(_gloo_stalls_on_rank_1, 2, timeout=60)
    expected = (
        "CommTimeoutError: gpucomm init_process_group on the world of 2 ranks: rank 0 timed out after 2 s "
        "waiting for rank(s) [1]: connecting the gloo group failed (DistStoreError: "
    )
    assert results[0].startswith(expected), results
    assert results[1] == "RuntimeError: rank 1 stalled before gloo", results


def _new_group_without_global_1(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    import gpucomm

    gpucomm.init_process_group(backend="gloo", timeout=20)
    store = dist.distributed_c10d._get_default_store()
    said = "not a member"
    if rank == 2:
        said = _outcome(lambda: gpucomm.new_group([1, 2], timeout=2, use_local_synchronization=True))
        store.set("test/done", "1")
    store.wait(["test/done"], datetime.timedelta(seconds=30))
    gpucomm.destroy_process_group()
    return said


def test_a_new_group_timeout_names_new_group_and_group_and_global_ranks() -> None:
    """Global rank 1 never makes the group [1, 2]; global rank 2, its group rank 1, waits for it."""
    results = run_ranks(_new_group_without_global_1, 3, timeout=60)
    assert results[2] == (
        "NeverJoinedError: gpucomm.new_group(backend='gpucomm') on the group of global ranks [1, 2]: group rank(s) "
        "[0] (global [1]) never joined (1 of 2 arrived after 2 s); every member must make the group"
    ), results


def _subgroup_without_global_1(rank: int, world_size: int) -> str:
    from gpucomm.comm.communicator import Communicator
    from gpucomm.config import Config

    store = rank_store(rank, world_size)
    with Communicator(store, rank, world_size, config=Config(transport="gloo", timeout=20)) as comm:
        said = "not called"
        if rank != 1:
            said = _outcome(lambda: comm.new_subgroup([1, 2], timeout=2))
        store_barrier(store, "done", rank, world_size)
        return said


def test_a_communicator_subgroup_timeout_names_the_group_and_global_ranks() -> None:
    """The same on a Communicator's own subgroups (gpucomm's groups beside torch's default group
    of another backend): the rank waits for its peers before gloo connects."""
    results = run_ranks(_subgroup_without_global_1, 3, timeout=60)
    assert results[0] == "ok", results  # not a member: nothing to wait for
    assert results[2] == (
        "CommTimeoutError: gpucomm new_group on the group of global ranks [1, 2]: group rank 1 (global 2) timed out "
        "after 2 s waiting for group rank(s) [0] (global [1])"
    ), results


def _inter_node_gloo_stalls_on_rank_1(rank: int, world_size: int) -> str:
    import gpucomm
    from gpucomm.algorithms import hierarchical

    if rank == 1:

        def stalled(self: object, *args: object) -> None:
            time.sleep(4)  # its node's workspace made, but never connects the inter-node group
            raise RuntimeError("rank 1 stalled before the inter-node group")

        hierarchical.InterNode.__init__ = stalled
    return _outcome(lambda: gpucomm.init_process_group(transport="shm", kernels="torch", timeout=2))


def test_an_inter_node_gloo_connect_timeout_names_the_inter_node_group() -> None:
    """Two "nodes" of one rank (GPUCOMM_LOCAL_WORLD_SIZE=1): the hierarchical path's inter-node
    gloo group of global ranks [0, 1] (before: a raw DistStoreError naming a gloo key)."""
    results = run_ranks(_inter_node_gloo_stalls_on_rank_1, 2, timeout=60, env={"GPUCOMM_LOCAL_WORLD_SIZE": "1"})
    expected = (
        "CommTimeoutError: gpucomm init (the inter-node gloo group) on the group of global ranks [0, 1]: group rank 0 "
        "(global 0) timed out after 2 s waiting for group rank(s) [1] (global [1]): connecting the inter-node gloo "
        "group failed (DistStoreError: "
    )
    assert results[0].startswith(expected), results
