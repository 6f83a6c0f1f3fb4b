"""Every collective across (pretended) nodes: the node's workspace inside, torch.distributed between.

Ranks on one machine pretend to be nodes (GPUCOMM_LOCAL_WORLD_SIZE, and two torchrun agents
with ``--nnodes 2``); every collective, dtype and op of the matrix (tests/support/collective_matrix.py)
runs at 2 x 2 and 2 x 3 ranks, checked against float64 references, in one spawned job per layout.
"""

from __future__ import annotations

import random

import pytest
from spawn import run_ranks

SIZES = (0, 1, 7, 515)


def _layout_rank(rank: int, world_size: int, seed: int, sizes: tuple[int, ...]) -> tuple[list[str], list[str], list[str]]:
    import io
    import logging

    import gpucomm as dist
    from collective_matrix import Matrix, run_everything

    dist.init_process_group(transport="shm", kernels="torch", debug="INFO", timeout=60)
    stream = io.StringIO()
    logging.getLogger("gpucomm").addHandler(logging.StreamHandler(stream))
    m = Matrix(seed)
    run_everything(m, sizes=sizes)
    dist.destroy_process_group()
    return m.failures, m.digests, stream.getvalue().splitlines()


@pytest.mark.parametrize(("world_size", "per_node"), [(4, 2), (6, 3)])
def test_every_collective_across_two_pretended_nodes(world_size: int, per_node: int) -> None:
    seed = random.randrange(1 << 30)
    env = {"GPUCOMM_LOCAL_WORLD_SIZE": str(per_node)}
    results = run_ranks(_layout_rank, world_size, seed, SIZES, timeout=600, env=env)
    failures = [f for r in results for f in r[0]]
    assert not failures, (seed, failures[:10])
    assert all(r[1] == results[0][1] for r in results), "all_reduce results differ between ranks"
