"""gpucomm.fused under TRITON_INTERPRET=1 on the shared-memory workspace, at 2 and 4 ranks:

- all_reduce_residual_rmsnorm equals gpucomm.all_reduce followed by residual_rmsnorm bit for bit
  (the contract), and a float64 reference within the dtype's rounding;
- all_gather_matmul equals all_gather_into_tensor followed by torch.matmul within the matmul's
  tolerance, staged in the device stage and in a heap buffer;
- all_gather_matmul's launches run by hand: the push launch waits for no one, and the matmul
  launch needs nothing but the other ranks' push launches (one of them late), with one program
  a tile and with programs that loop over several (tests/fused/test_residency.py: why);
- a rank that never arrives: the named CommTimeoutError within the deadline, the collectives
  still working, and the fused ops working again after gpucomm.fused.recover;
- bad arguments: typed errors before anything moves.
"""

from __future__ import annotations

import random
import time

import pytest
from fused_ranks import WORKSPACE, fused_against_unfused
from spawn import run_ranks

INTERPRET = {"TRITON_INTERPRET": "1"}


@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_ops_against_the_unfused_calls(world_size: int) -> None:
    seed = random.randrange(1 << 30)
    # Every dtype at 2 ranks; bf16, the decoders' dtype, at 4 (the interpreter is slow).
    dtypes = ("bfloat16", "float16", "float32") if world_size == 2 else ("bfloat16",)
    results = run_ranks(fused_against_unfused, world_size, seed, "cpu", dtypes, env=INTERPRET, timeout=600)
    assert results == [[]] * world_size, f"seed {seed}: {results}"


def _launches_by_hand(rank: int, world_size: int, seed: int) -> list[str]:
    """all_gather_matmul's launches (kernels/triton/fused_matmul.prepare), each rank running
    them when the test says, held apart by host barriers:

    - call 0: the last rank runs its first launch while every other rank is held before its
      own (the first launch waits for no one), and its second launch only once every other
      rank's second launch has ended (theirs wait for its first launch only);
    - call 1: rank 0 runs its first launch a second late, while the others' second launches
      wait for it; its second launch again after everyone else's.
    """
    import torch

    import gpucomm
    from gpucomm._kernels.triton import fused_matmul
    from gpucomm.fused._group import context
    from gpucomm.fused._matmul import _staging

    fn = "all_gather_matmul"
    gpucomm.init_process_group(transport="shm", kernels="triton", workspace_bytes=WORKSPACE, timeout=20)
    comm = gpucomm.get_default_communicator()
    problems = []
    m, k, n = 5, 16, 130  # 3 tiles of 64 columns a shard
    for call, late in enumerate((world_size - 1, 0)):
        g = torch.Generator().manual_seed(seed * 10 + call)
        shards = [torch.randn(m, k, generator=g) for _ in range(world_size)]
        b = torch.randn(k, n, generator=g) + rank
        out = torch.full((world_size * m, n), float("nan"))
        ctx = context(comm, shards[rank], fn)
        # Call 1's matmul launch runs 2 programs: program 0 loops over tiles 0 and 2.
        launches = fused_matmul.prepare(
            ctx, shards[rank], b, out, *_staging(comm, ctx, shards[rank]), matmul_blocks=2 if call else None
        )
        if len(launches) != 2:
            problems.append(f"call {call}: {len(launches)} launches, expected the push's and the matmul's")
            break
        publish, matmul = launches
        if call == 0:
            if rank == late:
                ctx.launch(fn, publish)  # alone: no other rank has launched anything
            comm.barrier()
            if rank != late:
                ctx.launch(fn, publish, matmul)  # waits for the late rank's first launch only
        elif rank == late:
            time.sleep(1.0)
            ctx.launch(fn, publish)
        else:
            ctx.launch(fn, publish, matmul)  # its tiles wait for the late push
        comm.barrier()
        if rank == late:
            ctx.launch(fn, matmul)
        expected = torch.cat(shards) @ b
        if not torch.allclose(out, expected, rtol=1e-5, atol=1e-4):
            off = float((out - expected).abs().nan_to_num(float("inf")).max())
            problems.append(f"call {call} (late rank {late}): off all_gather + matmul by {off:.3g}")
    gpucomm.destroy_process_group()
    return problems


def test_the_push_launch_waits_for_no_one_and_the_matmul_launch_needs_only_the_peers_push() -> None:
    # Blocks of one launch never wait on each other (DESIGN.md): a rank's tiles depend on no
    # program of their own launch, whatever a GPU makes resident, only on the peers' first
    # launch, which waits for nothing. Fails if the first launch waits for a peer, or if the
    # second pushes anything a peer waits for.
    seed = random.randrange(1 << 30)
    results = run_ranks(_launches_by_hand, 2, seed, env=INTERPRET, timeout=300)
    assert results == [[]] * 2, f"seed {seed}: {results}"


def _never_arrives(rank: int, world_size: int, timeout: float, op: str) -> dict:
    import torch

    import gpucomm
    import gpucomm.fused as gf

    gpucomm.init_process_group(transport="shm", kernels="triton", timeout=60)
    world = gpucomm.get_default_communicator()
    comm = world.new_subgroup(list(range(world_size)), timeout=timeout)  # the group under test
    x, w = torch.ones(2, 16), torch.ones(16)
    a, b = torch.ones(4, 8), torch.eye(8)

    def call() -> torch.Tensor:
        if op == "all_reduce_residual_rmsnorm":
            return gf.all_reduce_residual_rmsnorm(x, x, w, 1e-6, group=comm)[1]
        return gf.all_gather_matmul(a, b, group=comm)

    call()
    seen: dict = {}
    if rank != world_size - 1:  # the last rank never comes
        start = time.monotonic()
        try:
            call()
        except gpucomm.CommTimeoutError as err:
            seen = {"missing": err.missing, "op": err.op, "elapsed": time.monotonic() - start}
    world.barrier()
    t = torch.ones(3)
    comm.all_reduce(t)  # the group's collectives still work
    seen["all_reduce"] = t.tolist() == [float(world_size)] * 3
    gf.recover(group=comm)
    world.barrier()  # both ranks launch the next call together: the group's timeout is short
    seen["after_recover"] = float(call().sum())
    comm.close()
    gpucomm.destroy_process_group()
    return seen


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("op", ["all_reduce_residual_rmsnorm", "all_gather_matmul"])
def test_a_rank_that_never_arrives_is_named_and_the_group_recovers(op: str, world_size: int) -> None:
    timeout = 4.0
    results = run_ranks(_never_arrives, world_size, timeout, op, env=INTERPRET, timeout=300)
    for seen in results[:-1]:  # every rank that came names the one that did not
        assert seen["missing"] == [world_size - 1] and seen["op"] == op, seen
        assert timeout * 0.9 <= seen["elapsed"] <= timeout + 5, seen
    expected = 2 * 16 * (world_size + 1) if op == "all_reduce_residual_rmsnorm" else world_size * 4 * 8
    assert all(r["all_reduce"] and r["after_recover"] == expected for r in results), results


def _bad_inputs(rank: int, world_size: int) -> list[str]:
    import torch

    import gpucomm
    import gpucomm.fused as gf

    gpucomm.init_process_group(transport="shm", kernels="triton")
    x, w = torch.ones(2, 8), torch.ones(8)
    cases = [
        (TypeError, "x must be one of", lambda: gf.all_reduce_residual_rmsnorm(x.int(), x, w)),
        (TypeError, "residual has dtype", lambda: gf.all_reduce_residual_rmsnorm(x, x.half(), w)),
        (ValueError, "residual must have x's shape", lambda: gf.all_reduce_residual_rmsnorm(x, torch.ones(3, 8), w)),
        (
            ValueError,
            "weight must have x's last dimension 8",
            lambda: gf.all_reduce_residual_rmsnorm(x, x, torch.ones(4)),
        ),
        (ValueError, "eps must be a non-negative float", lambda: gf.all_reduce_residual_rmsnorm(x, x, w, -1.0)),
        (
            ValueError,
            "algo must be 'auto', 'oneshot' or 'twoshot'",
            lambda: gf.all_reduce_residual_rmsnorm(x, x, w, algo="ring"),
        ),
        (ValueError, "must be contiguous", lambda: gf.all_reduce_residual_rmsnorm(x.t(), x.t(), torch.ones(2))),
        (ValueError, "b must have a_shard's 8 columns", lambda: gf.all_gather_matmul(x, torch.ones(4, 3))),
        (ValueError, "a_shard must have 2 dimension(s)", lambda: gf.all_gather_matmul(w, torch.ones(8, 3))),
        (
            TypeError,
            "group must be a group from gpucomm.new_group()",
            lambda: gf.all_gather_matmul(x, torch.ones(8, 3), group="world"),
        ),
    ]
    problems = []
    for kind, words, call in cases:
        try:
            call()
            problems.append(f"no error: {words}")
        except kind as err:
            if words not in str(err) or "gpucomm.fused." not in str(err):
                problems.append(f"{kind.__name__} without '{words}': {err}")
    gpucomm.destroy_process_group()
    return problems


def test_bad_arguments_raise_typed_errors_before_anything_moves() -> None:
    assert run_ranks(_bad_inputs, 1, env=INTERPRET, timeout=120) == [[]]
