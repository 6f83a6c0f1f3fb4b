"""Every collective on the workspace path (shm transport), with every algorithm that serves it.

The torch reference kernels run the whole matrix: every collective × algorithm × dtype × op ×
size (0, 1, 7, 4099) at world sizes 2, 3 and 4, and again every collective × algorithm ×
dtype × op with 4099 elements in a 4 KiB workspace, where they span many pieces; a few small
cases at 8 ranks; and the hierarchical all_reduce of 4 ranks pretending to be 2 nodes of 2.
The real Triton kernels (TRITON_INTERPRET=1) run a lean subset that still touches every
algorithm, every op and every dtype, and the CUDA C++ kernels built for the host
(GPUCOMM_CUDA_EMULATE=1) run the same subset on the same inputs, bit for bit Triton's, and the torch
kernels' whole matrix at 2, 3 and 4 ranks and the small cases at 8. Results are checked against float64 references,
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


# The CUDA C++ kernels built for the host (GPUCOMM_CUDA_EMULATE=1), 64 threads a block.
EMULATE = {"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64"}


def _digests(results: list[dict]) -> dict[str, list[str]]:
    """Rank 0's all_reduce digests per label (every rank's are the same: check_results)."""
    return {label: digests for label, (_, digests, _) in results[0].items()}


def _same_bits(results: list[dict], others: list[dict], seed: int, what: str) -> None:
    for label, digests in _digests(results).items():
        assert digests == _digests(others)[label], (
            f"{label}, seed {seed}: all_reduce results differ bitwise from {what}"
        )


# The 4-rank case took 56 s on the 2-core CI machine, the slowest test of `.ci/run`; the 2- and
# 3-rank cases run the same matrix (3 also against the torch kernels bit for bit) and 8 the small
# cases at the most ranks, so 4 runs only under --run-slow.
@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow), 8])
def test_every_collective_and_algorithm_cuda_kernels(world_size: int) -> None:
    """The CUDA C++ program kernel built for the host: the torch kernels' whole matrix at 2, 3 and 4
    ranks (every collective x algorithm x dtype x op x size, and the many-pieces pass), the small
    cases at 8, on 1 to 3 channels; at 3 ranks the all_reduce results bitwise those of the torch kernels."""
    seed = random.randrange(1 << 30)
    if world_size == 8:
        import torch
        from collective_matrix import OPS

        args = ((1, 7), (torch.float32, torch.bfloat16, torch.int64), OPS)
        plan = [(algo, algo, {"algo": algo}, "full", args) for algo in ALGOS]
    else:
        plan = torch_plan(world_size)
    knobs = {**_knobs("cuda"), "channels": {2: 1, 3: 2, 4: 3, 8: 2}[world_size]}
    results = run_ranks(workspace_rank, world_size, seed, "cpu", knobs, plan, env=EMULATE, timeout=900)
    check_results(results, seed, labels_of(plan), kernels="cuda")
    if world_size == 3:  # the Triton test compares the families at 2, 3 and 4 ranks
        reference = run_ranks(workspace_rank, world_size, seed, "cpu", _knobs("torch"), plan, timeout=900)
        _same_bits(results, reference, seed, "the torch kernels'")


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
    if world_size == 3:
        # Two pieces of float64 on two channels: reduce_up's and broadcast_down's pieces must share
        # their bounds (a tree all_reduce once cut one in elements and the other in bytes).
        import torch
        from collective_matrix import OPS

        plan.append(("tree in pieces", "tree", {"algo": "tree"}, "full", ((4099,), (torch.float64,), OPS[:1])))
    knobs = {**_knobs("triton"), "channels": {2: 1, 3: 2, 4: 3}[world_size]}
    results = run_ranks(
        workspace_rank, world_size, seed, "cpu", knobs, plan, env={"TRITON_INTERPRET": "1"}, timeout=600
    )
    check_results(results, seed, labels_of(plan), kernels="triton")
    # The CUDA C++ kernels built for the host on the same plan and inputs: the same bits.
    cuda = {**knobs, "kernels": "cuda"}
    cuda_results = run_ranks(workspace_rank, world_size, seed, "cpu", cuda, plan, env=EMULATE, timeout=600)
    check_results(cuda_results, seed, labels_of(plan), kernels="cuda")
    _same_bits(cuda_results, results, seed, "the Triton kernels'")


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
