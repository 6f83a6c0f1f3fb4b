"""Broadcast and reduce spread over the links (gpucomm.algorithms.spread) give the direct forms' bits.

Reduce folds each element once, over the ranks in rank order, rounded once (AVG divided at that
fold): the spread form must give bitwise what the direct form gives, on the root, and leave the
other ranks' tensors as they were. Broadcast must copy the root's bytes. Sizes take one piece, and
many pieces of the 48K workspace (18 KiB halves), a last piece shorter than the others included.
"""

from __future__ import annotations

import random

import pytest
from spawn import run_ranks


def _ranks(rank: int, world_size: int, seed: int) -> list[str]:
    import torch

    import gpucomm
    from gpucomm import ReduceOp

    gpucomm.init_process_group(transport="shm", kernels="torch", workspace_bytes="48K", timeout=60)
    comm = gpucomm.get_default_communicator()
    spread = comm.new_subgroup(list(range(world_size)), algo="spread")
    direct = comm.new_subgroup(list(range(world_size)), algo="direct")
    failures = []
    for case, (n, dtype, op) in enumerate(
        [
            (7, torch.float32, ReduceOp.SUM),
            (4099, torch.bfloat16, ReduceOp.AVG),
            (50001, torch.float32, ReduceOp.SUM),  # 11 pieces of 18 KiB, the last one shorter
            (50001, torch.bfloat16, ReduceOp.MAX),
        ]
    ):
        g = torch.Generator().manual_seed(seed * 100 + case * 10 + rank)
        x = (torch.randn(n, generator=g) * 1e3).to(dtype)
        root = case % world_size
        a, b = x.clone(), x.clone()
        spread.reduce(a, root, op)
        direct.reduce(b, root, op)
        if rank == root and not torch.equal(
            a.view(torch.int16 if a.element_size() == 2 else torch.int32),
            b.view(torch.int16 if b.element_size() == 2 else torch.int32),
        ):
            failures.append(f"reduce n={n} {dtype} {op.name} root={root}: spread and direct differ in bits")
        if rank != root and not (torch.equal(a, x) or torch.isnan(x).any()):
            failures.append(f"reduce n={n} {dtype} {op.name}: rank {rank}'s tensor changed")
        c = x.clone() if rank == root else torch.full_like(x, -1)
        spread.broadcast(c, root)
        want = torch.empty_like(x)
        want.copy_(x)
        direct.broadcast(want, root)
        if not torch.equal(c, want):
            failures.append(f"broadcast n={n} {dtype} root={root}: rank {rank} differs from the root's bytes")
    gpucomm.destroy_process_group()
    return failures


@pytest.mark.parametrize("world_size", [3, 4])
def test_spread_broadcast_and_reduce_give_the_direct_bits(world_size: int) -> None:
    seed = random.randrange(1 << 30)
    results = run_ranks(_ranks, world_size, seed, timeout=300)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:20])
