"""gpucomm.language, the device API for users' Triton kernels, under TRITON_INTERPRET=1 on the
shared-memory workspace: peer pointers, stores to a peer with signal/wait, the barrier of the
tutorial (docs/tutorials/one_shot_all_reduce.py, run as written), the one-shot all_reduce written
with the API against the program kernel's bit for bit, and a rank that never arrives: a named
CommTimeoutError within the deadline, collectives that go on working, recovery."""

from __future__ import annotations

import os
import runpy
import time

import pytest
from spawn import run_ranks

INTERPRET = {"TRITON_INTERPRET": "1"}
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TUTORIAL = os.path.join(_REPO, "docs", "tutorials", "one_shot_all_reduce.py")


def _peers_and_ring(rank: int, world_size: int) -> list[str]:
    import torch
    from lang_kernels import ring_put, translate_addresses

    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels="triton", timeout=30)
    comm = gpucomm.get_default_communicator()
    ctx = comm.device_context()
    problems = []
    # The context comes first: the heap opens at this empty(), and its row of ctx.table is
    # filled then (DeviceContext.add_region), or no pointer into it would translate.
    x = comm.empty(37, dtype=torch.float32)
    got = torch.zeros(world_size, dtype=torch.int64)
    translate_addresses[(1,)](ctx.table, x, got, P=world_size)
    heap = comm._engines["cpu"].heap
    offset = x.data_ptr() - heap.base_addrs[rank]
    expected = [heap.base_addrs[p] + offset for p in range(world_size)]
    if got.tolist() != expected:
        problems.append(f"translate gave {got.tolist()}, expected {expected}")
    inbox = comm.empty(37, dtype=torch.float32)
    for value in (1, 2, 3):  # a user slot's values only grow: nothing is reset between calls
        mine = torch.arange(37, dtype=torch.float32) + 100 * rank + value
        out = torch.full((37,), float("nan"))

        # ctx.launch runs it within this iteration; the defaults bind the loop's values all the same.
        def put(mine: torch.Tensor = mine, out: torch.Tensor = out, value: int = value) -> None:
            ring_put[(1,)](ctx.table, mine, inbox, out, 37, value, BLOCK=64, LANES=128, num_warps=4)

        ctx.launch("ring_put", put)
        prev = (rank - 1) % world_size
        if not torch.equal(out, torch.arange(37, dtype=torch.float32) + 100 * prev + value):
            problems.append(f"ring_put value {value}: got {out[:4].tolist()}... from rank {prev}")
        comm.barrier()  # the next round overwrites the inbox
    gpucomm.destroy_process_group()
    return problems


@pytest.mark.parametrize("world_size", [2, 3])
def test_peer_pointers_and_signals(world_size: int) -> None:
    assert run_ranks(_peers_and_ring, world_size, env=INTERPRET, timeout=240) == [[]] * world_size


def _run_tutorial(rank: int, world_size: int) -> str:
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        runpy.run_path(TUTORIAL, run_name="__main__")
    return printed.getvalue()


def test_the_tutorial_runs_as_written() -> None:
    out = run_ranks(_run_tutorial, 2, env={**INTERPRET, "GPUCOMM_TRANSPORT": "shm"}, timeout=240)
    assert out == [f"rank {r}: one-shot all_reduce of 2 ranks on cpu: correct\n" for r in range(2)]


def _both_one_shots(rank: int, world_size: int, seed: int) -> list[str]:
    import torch
    from collective_matrix import make_input, poison

    import gpucomm
    from gpucomm.reduce_op import ReduceOp

    gpucomm.init_process_group(
        transport="shm", kernels="triton", algo="oneshot", workspace_bytes="16K", timeout=60, channels=2
    )
    program = gpucomm.get_default_communicator()
    lang = program.new_subgroup(list(range(world_size)), algo="oneshot_lang")
    problems = []
    case = 0
    ops = (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX, ReduceOp.PRODUCT)
    for i, dtype in enumerate((torch.bfloat16, torch.float16, torch.float32, torch.int32)):
        for j, n in enumerate((7, 4099)):  # the ops in turn: the kernels' numerics are test_cpu_kernels'
            for op in (ops[(i + j) % 4], ops[(i + j + 1) % 4]):
                case += 1
                x = make_input(seed, case, rank, n, dtype, op)
                a, b = x.clone(), poison(torch.empty_like(x)).copy_(x)
                program.all_reduce(a, op)
                lang.all_reduce(b, op)
                if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
                    problems.append(
                        f"{dtype} {op.name} n={n}: the two one-shots differ in {int((a != b).sum())} elements"
                    )
    lang.close()
    gpucomm.destroy_process_group()
    return problems


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_shot_written_with_the_api_is_the_program_kernels_bit_for_bit(world_size: int) -> None:
    # Two channels, 4099 elements over 3 KiB stage halves: several pieces, split between channels.
    import random

    seed = random.randrange(1 << 30)
    results = run_ranks(_both_one_shots, world_size, seed, env=INTERPRET, timeout=400)
    assert results == [[]] * world_size, f"seed {seed}: {results}"


def _never_arrives(rank: int, world_size: int, timeout: float) -> dict:
    import torch

    import gpucomm

    tutorial = runpy.run_path(TUTORIAL)  # its kernel and launcher, not its __main__
    gpucomm.init_process_group(transport="shm", kernels="triton", timeout=60)
    world = gpucomm.get_default_communicator()
    # The group under test has the short timeout; the world's long one lets ranks meet again.
    comm = world.new_subgroup(list(range(world_size)), timeout=timeout)
    x = comm.empty(64, dtype=torch.float32)
    x.fill_(rank + 1)
    out = torch.empty_like(x)
    tutorial["all_reduce"](x, out, comm)  # everyone, once
    seen: dict = {}
    if rank == 0:  # rank 1 never comes to the second one
        start = time.monotonic()
        try:
            tutorial["all_reduce"](x, out, comm)
        except gpucomm.CommTimeoutError as err:
            seen = {
                "missing": err.missing,
                "op": err.op,
                "rank": err.rank,
                "elapsed": time.monotonic() - start,
                "text": str(err),
            }
        try:  # the context stays failed until recovered, and says so
            tutorial["all_reduce"](x, out, comm)
        except gpucomm.CommTimeoutError as err:
            seen["again"] = "recover()" in str(err)
    world.barrier()
    # The collectives were never poisoned: the group goes on working.
    t = torch.full((10,), float(rank + 1))
    comm.all_reduce(t)
    seen["all_reduce"] = t.tolist() == [float(sum(range(1, world_size + 1)))] * 10
    comm.device_context().recover()  # every rank
    world.barrier()  # both ranks launch the next call together: the group's timeout is short
    x.fill_(rank + 1)
    tutorial["all_reduce"](x, out, comm)
    seen["after_recover"] = out.tolist() == [float(sum(range(1, world_size + 1)))] * 64
    comm.close()
    gpucomm.destroy_process_group()
    return seen


def test_a_rank_that_never_arrives_is_named_within_the_deadline_and_the_communicator_goes_on() -> None:
    timeout = 4.0
    results = run_ranks(_never_arrives, 2, timeout, env=INTERPRET, timeout=240)
    seen = results[0]
    assert seen["missing"] == [1] and seen["op"] == "one_shot_all_reduce" and seen["rank"] == 0, seen
    assert timeout * 0.9 <= seen["elapsed"] <= timeout + 5, seen
    assert "waiting for rank(s) [1]" in seen["text"], seen
    assert seen["again"], seen
    assert all(r["all_reduce"] and r["after_recover"] for r in results), results
