"""Every collective across (pretended) nodes: the node's workspace inside, torch.distributed between.

Ranks on one machine pretend to be nodes, with GPUCOMM_LOCAL_WORLD_SIZE and with two torchrun
agents (``--nnodes 2``). Every collective, dtype and op of the matrix
(tests/support/collective_matrix.py) runs at 2 x 2 and 2 x 3 ranks, checked against float64
references, in one spawned job per layout; the reductions are checked bit for bit against the
two-level order (each node's ranks in rank order, then the nodes in node order); the
GPUCOMM_DEBUG=INFO log names each stage's path. A double of NCCL stands in where a stage needs
it: every inter-node stage of a tensor that takes NCCL runs on the group it makes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import types
from pathlib import Path

import pytest
from spawn import free_port, run_ranks
from two_level import two_level, two_level_checks, wide

SIZES = (0, 1, 7, 515)
# Every collective the matrix calls, and the stages each logs where ranks span nodes.
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "barrier",
)
SCRIPT = Path(__file__).parents[1] / "support" / "scripts" / "across_nodes_script.py"


def _layout_rank(rank: int, world_size: int, seed: int, sizes: tuple[int, ...], per_node: int) -> tuple:
    import io
    import logging

    from collective_matrix import Matrix, run_everything

    import gpucomm as dist

    dist.init_process_group(transport="shm", kernels="torch", debug="INFO", timeout=60)
    stream = io.StringIO()
    logging.getLogger("gpucomm").addHandler(logging.StreamHandler(stream))
    m = Matrix(seed)
    run_everything(m, sizes=sizes)
    nodes = [list(range(k, k + per_node)) for k in range(0, world_size, per_node)]
    failures = m.failures + two_level_checks(rank, world_size, seed, nodes)
    dist.destroy_process_group()
    return failures, m.digests, stream.getvalue().splitlines()


def check_logs(logs: list[list[str]], path: str = "gloo") -> None:
    """Every collective took the hierarchical path on every rank, and logged its stages: in node
    on the workspace, between nodes on ``path`` (on the ranks that run each stage: a rooted
    collective's and a barrier's inter-node stage runs on one local rank per node); send and
    recv went through gloo."""
    for rank, lines in enumerate(logs):
        calls = [line for line in lines if " stage " not in line]
        off = [c for c in calls if "algo=hierarchical" not in c and "path=gloo" not in c]
        assert not off, off[:3]
        p2p = [c for c in calls if ": isend " in c or ": recv " in c]
        assert p2p and all("path=gloo" in c for c in p2p), p2p[:3]
        for fn in COLLECTIVES:
            assert any(f": {fn} " in c and "algo=hierarchical" in c for c in calls), (rank, fn)
    every = [line for lines in logs for line in lines]
    for fn in COLLECTIVES:
        stages = [line for line in every if f": {fn} stage " in line]
        assert any(f"between nodes path={path} group=" in s for s in stages), (fn, stages[:3])
        assert any(" in node " in s and "path=workspace algo=" in s for s in stages), (fn, stages[:3])
    assert not [line for line in every if "between nodes" in line and f"path={path}" not in line]


@pytest.mark.parametrize(("world_size", "per_node"), [(4, 2), (6, 3)])
def test_every_collective_across_two_pretended_nodes(world_size: int, per_node: int) -> None:
    seed = random.randrange(1 << 30)
    env = {"GPUCOMM_LOCAL_WORLD_SIZE": str(per_node)}
    results = run_ranks(_layout_rank, world_size, seed, SIZES, per_node, timeout=600, env=env)
    failures = [f for r in results for f in r[0]]
    assert not failures, (seed, failures[:10])
    assert all(r[1] == results[0][1] for r in results), "all_reduce results differ between ranks"
    check_logs([r[2] for r in results])


def test_the_two_level_order_is_not_the_flat_one() -> None:
    """The bitwise check can fail: the two-level order's bits differ from one flat rank-order fold
    on these inputs (so a composition that folded flat would be caught)."""
    import torch

    xs = [wide(1, 1, r, 4099, torch.float32) for r in range(4)]
    flat = xs[0].clone()
    for x in xs[1:]:
        flat = flat + x
    assert not torch.equal(two_level(xs, "SUM", [[0, 1], [2, 3]]), flat)
    assert torch.equal(two_level(xs, "SUM", [[0, 1, 2, 3]]), flat)


# -- NCCL between nodes, through a double ---------------------------------------------------------
def _nccl_double_rank(rank: int, world_size: int, seed: int) -> tuple:
    import io
    import logging

    import torch
    import torch.distributed as tdist
    from collective_matrix import Matrix

    import gpucomm as dist
    from gpucomm.algorithms import hierarchical

    made: list[int] = []
    calls: list[str] = []

    class NcclDouble:
        """Stands for ProcessGroupNCCL: gloo underneath, every call recorded."""

        def __init__(self, store, group_rank, size, timeout) -> None:
            made.append(size)
            self._gloo = tdist.ProcessGroupGloo(store, group_rank, size, timeout)

        def __getattr__(self, name: str):
            calls.append(name)
            return getattr(self._gloo, name)

    # Every tensor here takes the NCCL group, as a CUDA tensor does where torch has NCCL.
    hierarchical.takes_nccl = lambda tensor: True
    hierarchical.make_nccl = NcclDouble
    dist.init_process_group(transport="shm", kernels="torch", debug="INFO", timeout=60)
    stream = io.StringIO()
    logging.getLogger("gpucomm").addHandler(logging.StreamHandler(stream))
    m = Matrix(seed)
    for dtype in (torch.float32, torch.bfloat16):
        m.all_reduce(7, dtype, dist.ReduceOp.SUM)
        m.reduce(7, dtype, dist.ReduceOp.AVG)
        m.reduce_scatter(7, dtype, dist.ReduceOp.MAX, "tensor")
        m.broadcast(7, dtype)
        m.all_gather(7, dtype, "tensor")
        m.gather(7, dtype)
        m.scatter(7, dtype)
        m.all_to_all(7, dtype, "single")
    dist.destroy_process_group()
    return m.failures, made, sorted(set(calls)), stream.getvalue().splitlines()


def test_tensors_that_take_nccl_cross_nodes_on_the_nccl_group() -> None:
    results = run_ranks(
        _nccl_double_rank, 4, random.randrange(1 << 30), timeout=300, env={"GPUCOMM_LOCAL_WORLD_SIZE": "2"}
    )
    for failures, made, _calls, lines in results:
        assert not failures, failures[:5]
        assert made == [2], made  # one NCCL group per engine, of the 2 nodes
        between = [line for line in lines if "between nodes" in line]
        assert between and all("path=nccl" in line for line in between), between[:3]
    # Rooted collectives cross nodes on the root's local rank only: every op on some rank.
    calls = {call for result in results for call in result[2]}
    for op in ("allgather", "_allgather_base", "alltoall_base", "broadcast", "gather", "scatter"):
        assert op in calls, (op, calls)


def test_cuda_tensors_take_nccl_where_torch_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from gpucomm.algorithms import hierarchical

    cuda_tensor = types.SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(hierarchical.dist, "is_nccl_available", lambda: True)
    assert hierarchical.takes_nccl(cuda_tensor)
    assert not hierarchical.takes_nccl(torch.zeros(1))
    monkeypatch.setattr(hierarchical.dist, "is_nccl_available", lambda: False)
    assert not hierarchical.takes_nccl(cuda_tensor)  # a torch without NCCL: gloo


# -- two torchrun agents ------------------------------------------------------------------------
@pytest.mark.parametrize("per_node", [2, 3])
def test_two_torchrun_agents(tmp_path: Path, per_node: int) -> None:
    """``torchrun --nnodes 2`` twice on this machine: every collective across the two "nodes"."""
    port, seed = free_port(), random.randrange(1 << 30)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESULT_DIR": str(tmp_path), "SEED": str(seed)}
    # Each agent's output goes to a file: a pipe that nobody reads while the other agent is
    # waited for fills up, and blocks that agent's ranks in the middle of a collective.
    logs = [tmp_path / f"agent{node}.txt" for node in (0, 1)]
    agents = []
    for node, log in zip((0, 1), logs):
        with log.open("w") as out:
            agents.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--nnodes=2",
                        f"--node-rank={node}",
                        f"--nproc-per-node={per_node}",
                        "--master-addr=127.0.0.1",
                        f"--master-port={port}",
                        str(SCRIPT),
                    ],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    try:
        for agent in agents:
            agent.wait(timeout=400)
    finally:  # a hung agent (and its ranks) must not outlive the test
        for agent in agents:
            if agent.poll() is None:
                agent.terminate()  # torchrun stops its workers on SIGTERM, not on SIGKILL
                try:
                    agent.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    agent.kill()
                    agent.wait()
    assert all(a.returncode == 0 for a in agents), [log.read_text()[-3000:] for log in logs]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2 * per_node)]
    failures = [f for r in results for f in r["failures"]]
    assert not failures, (seed, failures[:10])
    assert all(r["digests"] == results[0]["digests"] for r in results)
    assert [r["local_world_size"] for r in results] == [per_node] * (2 * per_node)
    check_logs([r["log"] for r in results])


# -- nodes of different sizes -------------------------------------------------------------------
def _stated_sizes_rank(rank: int, world_size: int) -> str:
    import gpucomm as dist

    try:  # two "agents" of 2 and 1 ranks: each rank states its own agent's size
        dist.init_process_group(transport="shm", kernels="torch", local_world_size=2 if rank < 2 else 1, timeout=20)
    except dist.UnsupportedError as err:
        return str(err)
    return "no error"


def test_ranks_that_state_different_node_sizes_fail_on_every_rank() -> None:
    results = run_ranks(_stated_sizes_rank, 3, timeout=120)
    assert all("rank 0: 2, rank 1: 2, rank 2: 1" in r for r in results), results
    assert all("nodes of different sizes are not supported" in r for r in results), results


def _uneven_nodes_rank(rank: int, world_size: int) -> tuple[list[str], list[str]]:
    import io
    import logging

    import torch

    import gpucomm as dist

    stream = io.StringIO()
    logging.getLogger("gpucomm").addHandler(logging.StreamHandler(stream))
    dist.init_process_group(transport="auto", kernels="torch", debug="INFO", timeout=20)
    failures = []
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    if not torch.equal(t, torch.full((5,), 6.0)):
        failures.append(f"rank {rank}: all_reduce gave {t}")
    outs = [torch.empty(2) for _ in range(world_size)]
    dist.all_gather(outs, torch.full((2,), float(rank)))
    if not torch.equal(torch.stack(outs), torch.arange(3.0).repeat_interleave(2).view(3, 2)):
        failures.append(f"rank {rank}: all_gather gave {outs}")
    dist.destroy_process_group()
    return failures, stream.getvalue().splitlines()


def test_nodes_of_different_sizes_go_through_gloo_and_say_so() -> None:
    """3 ranks, 2 a node: nodes of 2 and 1 ranks. No workspace layout serves them: gloo does,
    and rank 0 says so once."""
    results = run_ranks(_uneven_nodes_rank, 3, timeout=120, env={"GPUCOMM_LOCAL_WORLD_SIZE": "2"})
    assert not [f for r in results for f in r[0]]
    warned = [line for r in results for line in r[1] if "nodes of different sizes" in line]
    assert len(warned) == 1 and "nodes of [2, 1] ranks" in warned[0], warned
    calls = [line for r in results for line in r[1] if line.startswith("gpucomm[rank")]
    assert calls and all("path=gloo" in line for line in calls), calls[:3]
