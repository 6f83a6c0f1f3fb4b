"""Every collective on the workspace path (shm transport), with every algorithm that serves it.

The torch reference kernels run the whole matrix: every collective × algorithm × dtype × op ×
size (0, 1, 7, 4099) at world sizes 2, 3 and 4, and again every collective × algorithm ×
dtype × op with 4099 elements in a 4 KiB workspace, where they span many pieces; a few small
cases at 8 ranks; and the hierarchical all_reduce of 4 ranks pretending to be 2 nodes of 2.
The real Triton kernels (TRITON_INTERPRET=1) run a lean subset that still touches every
algorithm, every op and every dtype. Results are checked against float64 references,
all_reduce results must be bitwise identical on every rank, and every call must say
``path=workspace`` with the forced algorithm in the GPUCOMM_DEBUG=INFO log.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from collective_matrix import workspace_rank
from collective_plans import ALGOS, TINY, WORKSPACE, check_results, labels_of, torch_plan
from spawn import run_ranks


def _knobs(kernels: str) -> dict:
    return {"transport": "shm", "kernels": kernels, "workspace_bytes": WORKSPACE, "timeout": 60}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_collective_and_algorithm_torch_kernels(world_size: int) -> None:
    seed = random.randrange(1 << 30)
    plan = torch_plan(world_size)
    results = run_ranks(workspace_rank, world_size, seed, "cpu", _knobs("torch"), plan, timeout=600)
    check_results(results, seed, labels_of(plan))


def test_eight_ranks_small_cases_torch_kernels() -> None:
    import torch
    from collective_matrix import OPS

    seed = random.randrange(1 << 30)
    args = ((1, 7), (torch.float32, torch.bfloat16, torch.int64), OPS)
    plan = [(algo, algo, {"algo": algo}, "full", args) for algo in ALGOS]
    results = run_ranks(workspace_rank, 8, seed, "cpu", _knobs("torch"), plan, timeout=600)
    check_results(results, seed, labels_of(plan))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_algorithm_op_and_dtype_triton_kernels(world_size: int) -> None:
    """The real Triton program kernel under the interpreter: every algorithm, each with every dtype
    and every op at least once, at 7 elements; at 3 ranks also at 2053 elements in a 4 KiB
    workspace for the pipelined algorithms (ring: 1 to 4 segments of 3 chunks, tree: 3 to 11
    pieces, by dtype; 47 s on the 2-core CI machine, against 75 s at 4099 elements, whose more
    pieces the torch kernels run); at 4 ranks the hierarchical one. The
    kernel runs 1, 2 and 3 channels at 2, 3 and 4 ranks, so that instructions are split between
    channels at odd boundaries."""
    seed = random.randrange(1 << 30)
    plan = [(algo, algo, {"algo": algo}, "lean", ((7,),)) for algo in ALGOS]
    if world_size == 3:
        plan += [
            (f"{algo} in 4K", algo, {"algo": algo, "workspace_bytes": TINY}, "lean", ((2053,),))
            for algo in ("ring", "tree")
        ]
    if world_size == 4:
        plan.append(("hierarchical", "hierarchical", {"local_world_size": 2}, "lean", ((7, 4099),)))
    knobs = {**_knobs("triton"), "channels": {2: 1, 3: 2, 4: 3}[world_size]}
    results = run_ranks(
        workspace_rank, world_size, seed, "cpu", knobs, plan, env={"TRITON_INTERPRET": "1"}, timeout=600
    )
    check_results(results, seed, labels_of(plan), kernels="triton")


def _misuse(rank: int, world_size: int) -> list[str]:
    """Each misuse on its own Communicator (a failed call breaks its communicator)."""
    import time

    import torch

    import gpucomm
    from gpucomm.comm.communicator import Communicator

    gpucomm.init_process_group(transport="shm", kernels="torch", workspace_bytes=WORKSPACE, timeout=60)
    world = gpucomm.get_default_communicator()
    seen = []

    def comm(name: str, timeout: float = 60.0) -> Communicator:
        config = dataclasses.replace(world.config, timeout=timeout)
        return Communicator(world.store, rank, world_size, prefix=f"{world.prefix}{name}/", config=config)

    # Both ranks believe they are the root: each sees the other's fingerprint.
    with comm("roots") as c:
        try:
            c.broadcast(torch.ones(5), src=rank)
        except gpucomm.CommMismatchError as err:
            seen.append(f"broadcast: {err}")
    # all_to_all_single whose split sizes disagree between the ranks: every rank sees every pair.
    with comm("splits") as c:
        # Rank 0 sends 2 elements to rank 1, which expects 1 (and the other way round).
        ins = [[1, 2], [1, 1]][rank]
        outs = [[1, 2], [1, 1]][rank]
        try:
            c.all_to_all_single(torch.zeros(sum(outs)), torch.ones(sum(ins)), outs, ins)
        except gpucomm.CommMismatchError as err:
            seen.append(f"all_to_all: {err}")
    # A recv that nobody matches ends in CommTimeoutError naming the sender.
    with comm("p2p", timeout=1.5) as c:
        if rank == 0:
            start = time.monotonic()
            try:
                c.recv(torch.zeros(3), src=1, tag=9)
            except gpucomm.CommTimeoutError as err:
                assert err.missing == [1] and err.rank == 0, str(err)
                assert 1.4 <= time.monotonic() - start <= 10, time.monotonic() - start
                seen.append(f"recv: {err}")
            world.store.set(f"{world.prefix}misuse_done", b"1")
        else:
            world.store.wait([f"{world.prefix}misuse_done"])
    gpucomm.destroy_process_group()
    return seen


def test_misuse_raises_on_every_rank() -> None:
    results = run_ranks(_misuse, 2, timeout=120)
    for rank, seen in enumerate(results):
        kinds = [s.split(":")[0] for s in seen]
        assert kinds == ["broadcast", "all_to_all"] + (["recv"] if rank == 0 else []), seen
    assert "different collectives" in results[0][0] and "roots" in results[0][0]
    for seen in results:
        assert "rank 0 sends 8 bytes to rank 1, which expects 4" in seen[1], seen[1]
    assert "waiting for rank(s) [1]" in results[0][2]
