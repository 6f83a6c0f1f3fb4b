"""all_reduce_into(output, input): the reduction of every rank's input in output, the input unchanged.

Every algorithm (forced per group), several dtypes and ops, sizes of one and of many pieces (16 KiB
workspaces: 6 KiB halves), on the shm workspace with the torch kernels at 2 and 3 ranks, and with the
Triton program kernel (interpreter) and the CUDA C++ one (host image) at 2 ranks: output poisoned
first, against a float64 reference of fresh random inputs, the input bitwise unchanged, the output
bitwise all_reduce's on a copy (tests/support/into_ranks.py: the rank body
tests/gpu/test_all_reduce_into_gpu.py runs on CUDA tensors). Bad pairs raise on the caller before
any data moves; the gloo path and the hierarchical form (two nodes of one rank) copy, then run in
place, with the same results.
"""

from __future__ import annotations

import random

import pytest
from into_ranks import check_into_results, into_rank
from spawn import run_ranks

EMULATE = {"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64"}


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_into_on_the_workspace_torch_kernels(world_size: int) -> None:
    seed = random.randrange(1 << 30)
    logs = check_into_results(run_ranks(into_rank, world_size, seed, "torch", "shm", timeout=300), seed)
    # DEBUG says which form served each call: the out-of-place programs, and the tree's copy first.
    assert "all_reduce_into: out-of-place program, algo=twoshot" in logs[0]
    assert "all_reduce_into: out-of-place program, algo=ring" in logs[0]
    assert "all_reduce_into: output.copy_(input), then in place (algo=tree runs in place only)" in logs[0]


def test_all_reduce_into_on_gloo() -> None:
    seed = random.randrange(1 << 30)
    logs = check_into_results(run_ranks(into_rank, 2, seed, "torch", "gloo", timeout=300), seed)
    assert "output.copy_(input), then in place (gloo has no out-of-place all_reduce)" in logs[0]


@pytest.mark.parametrize("kernels", ["triton", "cuda"])
def test_all_reduce_into_with_the_program_kernels(kernels: str) -> None:
    seed = random.randrange(1 << 30)
    env = {"TRITON_INTERPRET": "1"} if kernels == "triton" else EMULATE
    check_into_results(run_ranks(into_rank, 2, seed, kernels, "shm", env=env, timeout=600), seed)


def _bad_pairs(rank: int, world_size: int) -> list[str]:
    import torch

    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels="torch", workspace_bytes="16K", timeout=60)
    seen = []
    buf = torch.arange(32, dtype=torch.float32)
    before = buf.clone()
    bad = [
        (buf[8:24], buf[0:16], ValueError, r"all_reduce_into: output must be input itself or share no byte"),
        (torch.zeros(16), torch.zeros(8), ValueError, r"all_reduce_into: output must have the shape of input"),
        (torch.zeros(4, 4), torch.zeros(16), ValueError, r"all_reduce_into: output must have the shape of input"),
        (torch.zeros(16, dtype=torch.float64), buf[:16], TypeError, r"all_reduce_into: output has dtype"),
        (buf[::2], buf[16:], ValueError, r"all_reduce_into: output must be contiguous"),
    ]
    for out, inp, kind, pattern in bad:
        try:
            gpucomm.all_reduce_into(out, inp)
            seen.append(f"no error for {pattern}")
        except kind as err:
            import re

            if not re.search(pattern, str(err)):
                seen.append(f"wrong message: {err}")
    if not torch.equal(buf, before):
        seen.append("data moved before the error")
    # Nothing was numbered or sent: the next call still agrees on every rank.
    out = torch.empty(16)
    gpucomm.all_reduce_into(out, buf[16:])
    if not torch.equal(out, before[16:] * world_size):
        seen.append(f"the call after the errors is wrong: {out}")
    # One shape, both forms, in turn: two cached programs, the out-of-place one keyed apart (its
    # ``local``), and each form keeps its own result.
    engine = gpucomm.get_default_communicator()._engines["cpu"]
    engine._programs.clear()
    for _ in range(2):
        x, y = buf[16:].clone(), torch.full((16,), -1.0)
        gpucomm.all_reduce_into(y, x)
        gpucomm.all_reduce(x)
        if not (torch.equal(x, before[16:] * world_size) and torch.equal(y, x)):
            seen.append(f"in place then out of place: {x} {y}")
    keys = [k for k in engine._programs if k[0] == "all_reduce"]
    if sorted(k[3] for k in keys) != [(), ("into",)]:
        seen.append(f"cached programs: {keys}")
    # A blocking call on a pair seen before: the kept launch (gpucomm.workspace.repeat), fresh values each time.
    comm = gpucomm.get_default_communicator()
    x, y = torch.empty(16), torch.empty(16)
    for step in range(3):
        x.fill_(step + rank)
        y.fill_(-7.0)
        gpucomm.all_reduce_into(y, x)
        want = float(sum(step + r for r in range(world_size)))
        if not (torch.equal(y, torch.full((16,), want)) and torch.equal(x, torch.full((16,), float(step + rank)))):
            seen.append(f"repeat {step}: {y} {x}")
    if comm._repeat.find(x, gpucomm.ReduceOp.SUM, y) is None or comm._repeat.find(x, gpucomm.ReduceOp.SUM) is not None:
        seen.append("the out-of-place pair was not kept apart from the in-place call")
    if comm._repeat.find(x, gpucomm.ReduceOp.SUM, y.view(4, 4)) is not None:
        seen.append("a view of another shape took the kept launch")
    gpucomm.destroy_process_group()
    return seen


def test_bad_pairs_raise_before_any_data_moves() -> None:
    results = run_ranks(_bad_pairs, 2, timeout=120)
    assert results == [[], []], results


def _across_nodes(rank: int, world_size: int) -> tuple[bool, str]:
    import io
    import logging

    import torch

    import gpucomm

    stream = io.StringIO()
    gpucomm.init_process_group(transport="shm", kernels="torch", timeout=60)
    logging.getLogger("gpucomm").addHandler(logging.StreamHandler(stream))
    logging.getLogger("gpucomm").setLevel(logging.DEBUG)
    x = torch.arange(1000, dtype=torch.float32) + rank
    kept, out = x.clone(), torch.full((1000,), float("nan"))
    gpucomm.all_reduce_into(out, x)
    want = sum(torch.arange(1000, dtype=torch.float32) + r for r in range(world_size))
    ok = torch.equal(out, want) and torch.equal(x, kept)
    gpucomm.destroy_process_group()
    return ok, stream.getvalue()


def test_across_nodes_copies_then_runs_in_place() -> None:
    # GPUCOMM_LOCAL_WORLD_SIZE=1: two nodes of one rank, the hierarchical form (no out-of-place program).
    results = run_ranks(_across_nodes, 2, env={"GPUCOMM_LOCAL_WORLD_SIZE": "1"}, timeout=120)
    assert all(ok for ok, _ in results), results
    assert "output.copy_(input), then in place (algo=hierarchical runs in place only)" in results[0][1], results[0][1]
