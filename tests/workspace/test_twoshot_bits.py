"""Two-shot gives one-shot's bits in every schedule: one piece (two syncs) and pipelined (more than one
piece: one sync a piece), with each rank folding
its own slice from its tensor and the pieces cut short-first (the kernel contract: an element's
result depends only on its inputs, dtype and op, never on the algorithm or the message size).
"""

from __future__ import annotations

import random

import pytest
from spawn import run_ranks


def _ranks(rank: int, world_size: int, seed: int) -> list[str]:
    import torch

    import gpucomm
    from gpucomm import ReduceOp

    # 16K: 6 KiB halves. 7 elements: one piece; 4099 fp32: 3 pieces; 20011: 14-27 pieces.
    gpucomm.init_process_group(transport="shm", kernels="torch", workspace_bytes="16K", timeout=60)
    comm = gpucomm.get_default_communicator()
    groups = {algo: comm.new_subgroup(list(range(world_size)), algo=algo) for algo in ("oneshot", "twoshot")}
    failures = []
    assert 20011 * 2 > 6144  # the largest case is more than one piece, pipelined, in every dtype here
    for case, (n, dtype, op) in enumerate(
        [
            (7, torch.float32, ReduceOp.SUM),
            (4099, torch.float32, ReduceOp.AVG),
            (20011, torch.float32, ReduceOp.SUM),
            (20011, torch.bfloat16, ReduceOp.AVG),
            (20011, torch.float16, ReduceOp.MAX),
        ]
    ):
        g = torch.Generator().manual_seed(seed * 100 + case * 10 + rank)
        x = (torch.randn(n, generator=g) * 1e3).to(dtype)
        out = {}
        for algo, group in groups.items():
            out[algo] = x.clone()
            group.all_reduce(out[algo], op)
        view = torch.int16 if x.element_size() == 2 else torch.int32
        if not torch.equal(out["oneshot"].view(view), out["twoshot"].view(view)):
            failures.append(f"all_reduce n={n} {dtype} {op.name}: two-shot and one-shot differ in bits")
    gpucomm.destroy_process_group()
    return failures


@pytest.mark.parametrize("world_size", [3, 4])
def test_two_shot_gives_one_shots_bits_in_every_schedule(world_size: int) -> None:
    seed = random.randrange(1 << 30)
    results = run_ranks(_ranks, world_size, seed, timeout=300)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:20])
