"""The checked gloo path (gpucomm.gloo.checked): one gloo collective per small call, two per large
one; the check before any result is written; the small form's numerics equal to the workspace
path's; a small call that returns before its peers have arrived."""

from __future__ import annotations

import random

from spawn import run_ranks

# Matrix calls and how each is made, at sizes on both sides of the slot's capacity.
_REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter[list]", "reduce_scatter[tensor]")
_MOVEMENT = ("broadcast", "all_gather[list]", "all_gather[tensor]", "gather", "scatter")
_ALL_TO_ALL = ("all_to_all[list]", "all_to_all[single]", "all_to_all_equal")


class _Counting:
    """Stands in for a ProcessGroupGloo and counts the collectives started on it."""

    def __init__(self, pg: object) -> None:
        self._pg = pg
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> object:
        attr = getattr(self._pg, name)
        if name in ("shutdown", "monitored_barrier") or not callable(attr):
            return attr

        def call(*args: object, **kwargs: object) -> object:
            self.calls.append(name)
            return attr(*args, **kwargs)

        return call


def _run(m: object, name: str, n: int, dtype: object) -> None:
    from gpucomm.reduce_op import ReduceOp

    kind, _, form = name.partition("[")
    form = form.rstrip("]")
    if kind in ("all_reduce", "reduce"):
        getattr(m, kind)(n, dtype, ReduceOp.AVG)
    elif kind == "reduce_scatter":
        m.reduce_scatter(n, dtype, ReduceOp.MAX, form)
    elif kind in ("all_gather", "all_to_all"):
        getattr(m, kind)(n, dtype, form)
    else:
        getattr(m, kind)(n, dtype)


def _forms(rank: int, world_size: int, seed: int) -> tuple[list[str], list[str], dict[str, list[int]]]:
    import torch
    from collective_matrix import Matrix

    import gpucomm
    from gpucomm.gloo.checked import capacity

    gpucomm.init_process_group(transport="gloo", timeout=60)
    counting = _Counting(gpucomm.get_default_communicator()._fallback.pg)
    gpucomm.get_default_communicator()._fallback.pg = counting
    m = Matrix(seed)
    counts: dict[str, list[int]] = {}
    for dtype in (torch.float32, torch.float16):
        size = torch.empty(0, dtype=dtype).element_size()
        fits = {name: capacity(name, world_size) // size for name in (*_REDUCTIONS, *_MOVEMENT, *_ALL_TO_ALL)}
        for name in ("all_to_all[list]", "all_to_all[single]"):
            fits[name] -= 2  # the pair (r, j) carries (r + j) % 3 + n elements (Matrix.all_to_all)
        for name, most in fits.items():
            for n in (most, most + 1):
                counting.calls.clear()
                _run(m, name, n, dtype)
                counts.setdefault(f"{name} {dtype}", []).append(len(counting.calls))
    counting.calls.clear()
    m.barrier()
    counts["barrier"] = [len(counting.calls)]
    gpucomm.get_default_communicator()._fallback.pg = counting._pg
    gpucomm.destroy_process_group()
    return m.failures, m.digests, counts


def test_small_form_is_one_gloo_collective_and_large_form_two() -> None:
    seed = random.randrange(1 << 30)
    results = run_ranks(_forms, 3, seed, timeout=300)
    failures = [f for fails, _, _ in results for f in fails]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:40])
    assert all(d == results[0][1] for _, d, _ in results), f"seed {seed}: all_reduce results differ between ranks"
    for rank, (_, _, counts) in enumerate(results):
        assert counts.pop("barrier") == [1], f"rank {rank}: barrier"
        for case, (at_capacity, above) in counts.items():
            assert (at_capacity, above) == (1, 2), f"rank {rank}: {case}: {at_capacity} and {above} gloo collectives"


def _untouched(rank: int, world_size: int) -> dict[str, bool]:
    """Mismatched small calls, each on a fresh group: every rank raises, outputs keep their poison."""
    import torch

    import gpucomm

    poison = -7.0
    cases = {
        "all_reduce op": lambda t: gpucomm.all_reduce(
            t, op=gpucomm.ReduceOp.SUM if rank == 0 else gpucomm.ReduceOp.MAX
        ),
        "all_reduce async": lambda t: gpucomm.all_reduce(t[: 4 + rank], async_op=True).wait(),
        "broadcast size": lambda t: gpucomm.broadcast(t[: 4 + rank], src=0),
        "all_gather_into_tensor size": lambda t: gpucomm.all_gather_into_tensor(
            t[: 2 * (4 + rank)], torch.ones(4 + rank)
        ),
        "reduce_scatter_tensor size": lambda t: gpucomm.reduce_scatter_tensor(
            t[: 4 + rank], torch.ones(2 * (4 + rank))
        ),
        "gather size": lambda t: gpucomm.gather(torch.ones(4 + rank), list(t[:8].chunk(2)) if rank == 0 else None),
        "scatter size": lambda t: gpucomm.scatter(
            t[: 4 + rank], list(torch.ones(8 + 2 * rank).chunk(2)) if rank == 0 else None
        ),
        "all_to_all_single splits": lambda t: gpucomm.all_to_all_single(
            t[:2], torch.ones(2), [1, 1] if rank == 0 else [2, 0], [1, 1]
        ),
    }
    untouched = {}
    for name, call in cases.items():
        gpucomm.init_process_group(transport="gloo", timeout=20)
        t = torch.full((16,), poison)
        try:
            call(t)
        except gpucomm.CommMismatchError:
            untouched[name] = bool((t == poison).all())
        else:
            untouched[name] = False  # not raised at all
        gpucomm.destroy_process_group()
    return untouched


def test_mismatch_in_the_small_form_raises_everywhere_and_writes_nothing() -> None:
    for rank, untouched in enumerate(run_ranks(_untouched, 2, timeout=180)):
        bad = [name for name, ok in untouched.items() if not ok]
        assert not bad, f"rank {rank}: no CommMismatchError, or the output was written: {bad}"


def _both_paths(rank: int, world_size: int, seed: int) -> list[tuple[str, bytes, bytes]]:
    import dataclasses

    import torch
    from collective_matrix import make_input

    import gpucomm
    from gpucomm.comm.communicator import Communicator
    from gpucomm.reduce_op import ReduceOp

    gpucomm.init_process_group(transport="gloo", timeout=60)
    world = gpucomm.get_default_communicator()
    shm = Communicator(
        world.store,
        rank,
        world_size,
        prefix=f"{world.prefix}shm/",
        config=dataclasses.replace(world.config, transport="shm"),
    )
    results = []
    case = 0
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN):
            for n in (1, 7, 1000):
                case += 1
                mine = make_input(seed, case, rank, n, dtype, op)
                on_gloo, on_shm = mine.clone(), mine.clone()
                world.all_reduce(on_gloo, op)
                shm.all_reduce(on_shm, op)
                results.append(
                    (
                        f"{dtype} {op.name} n={n}",
                        on_gloo.view(torch.uint8).numpy().tobytes(),
                        on_shm.view(torch.uint8).numpy().tobytes(),
                    )
                )
    assert "workspace transport=shm" in shm.paths()["cpu"] and world.paths()["cpu"] == "gloo"
    shm.close()
    gpucomm.destroy_process_group()
    return results


def test_small_form_is_bitwise_the_workspace_path() -> None:
    seed = random.randrange(1 << 30)
    results = run_ranks(_both_paths, 3, seed, timeout=180)
    for rank, cases in enumerate(results):
        differ = [name for name, gloo, shm in cases if gloo != shm]
        assert not differ, f"seed {seed}, rank {rank}: gloo's small form and the shm workspace differ: {differ}"
        assert [c[1] for c in cases] == [c[1] for c in results[0]], f"seed {seed}: rank {rank} differs from rank 0"


def _returns_early(rank: int, world_size: int, late: float) -> tuple[float, list[float]]:
    import time

    import torch

    import gpucomm

    gpucomm.init_process_group(transport="gloo", timeout=30)
    gpucomm.barrier()
    t = torch.full((5,), float(rank + 1))
    if rank == 1:
        time.sleep(late)
    start = time.monotonic()
    work = gpucomm.all_reduce(t, async_op=True)
    returned = time.monotonic() - start
    work.wait()
    gpucomm.destroy_process_group()
    return returned, t.tolist()


def test_small_call_returns_before_its_peers_arrive() -> None:
    late = 1.0
    results = run_ranks(_returns_early, 2, late, timeout=60)
    assert all(values == [3.0] * 5 for _, values in results), results
    assert results[0][0] < late / 2, f"rank 0's call waited {results[0][0]:.2f} s for a peer {late} s late"


def _many_ranks(rank: int, world_size: int, seed: int) -> tuple[list[str], list[str], str]:
    """Slots too small for all_to_all's sizes (as with many ranks): they travel in a second exchange."""
    import torch
    from collective_matrix import Matrix

    import gpucomm
    import gpucomm.gloo.checked as checked

    checked._EXCHANGE_BYTES = 64  # the smallest slot, 64 bytes, at 4 ranks: 72 bytes of sizes
    assert checked.slot_bytes(world_size) == 64 and checked.capacity("all_to_all", world_size) < 0
    gpucomm.init_process_group(transport="gloo", timeout=30)
    m = Matrix(seed)
    for n in (0, 3):
        m.all_to_all(n, torch.float32, "list")
        m.all_to_all(n, torch.int64, "single")
        m.all_reduce(n, torch.float32, gpucomm.ReduceOp.SUM)
    m.all_reduce(100, torch.float32, gpucomm.ReduceOp.SUM)  # large at this slot
    splits = [1] * world_size
    if rank == 2:
        splits[0], splits[1] = 2, 0  # expects 2 rows from rank 0, which sends 1
    try:
        gpucomm.all_to_all_single(torch.zeros(world_size), torch.ones(world_size), splits, [1] * world_size)
        message = "no error"
    except gpucomm.CommMismatchError as err:
        message = str(err)
    gpucomm.destroy_process_group()
    return m.failures, m.digests, message


def test_all_to_all_sizes_beyond_a_slot_take_a_second_exchange() -> None:
    seed = random.randrange(1 << 30)
    results = run_ranks(_many_ranks, 4, seed, timeout=120)
    failures = [f for fails, _, _ in results for f in fails]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:20])
    for rank, (_, _, message) in enumerate(results):
        assert "rank 0 sends 4 bytes to rank 2, which expects 8" in message, f"rank {rank}: {message}"
