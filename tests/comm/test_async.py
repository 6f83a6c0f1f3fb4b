"""Asynchronous collectives on the CPU, as torch.distributed users expect them.

On gpucomm's gloo path an ``async_op=True`` call returns at once and its Work completes in the
background; ``is_completed()`` never blocks; ``get_future()`` chains; DDP's gpucomm hook hands
back a Future before the bucket is reduced, and the result is unchanged; a peer that dies while
the caller is busy elsewhere is found by the watchdog, which breaks the communicator and names the
culprit. On the shared-memory path an asynchronous call returns at once too: it runs on the
communicator's progress thread, in call order with blocking calls, with the same errors.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from spawn import free_port, run_ranks

GLOO = {"transport": "gloo"}


def _in_flight(rank: int, world_size: int, knobs: dict) -> tuple[list[bool], float]:
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=60, **knobs)
    P = world_size
    if rank == P - 1:
        time.sleep(0.5)  # the others' calls cannot complete before this rank joins
    x = torch.full((1000,), float(rank + 1))
    gathered = torch.empty(1000 * P)
    b = torch.full((7,), float(rank))
    rs_in, rs_out = torch.arange(10.0 * P) * (rank + 1), torch.empty(10)
    start = time.monotonic()
    works = [
        gpucomm.all_reduce(x, async_op=True),
        gpucomm.all_gather_into_tensor(gathered, torch.full((1000,), float(rank)), async_op=True),
        gpucomm.broadcast(b, src=P - 1, async_op=True),
        gpucomm.reduce_scatter_tensor(rs_out, rs_in, async_op=True),
    ]
    issued = time.monotonic() - start
    for work in reversed(works):  # any order of waits: each completes its own collective
        work.wait()
    total = sum(range(1, P + 1))
    ok = [
        torch.equal(x, torch.full((1000,), float(total))),
        torch.equal(gathered, torch.cat([torch.full((1000,), float(r)) for r in range(P)])),
        torch.equal(b, torch.full((7,), float(P - 1))),
        torch.equal(rs_out, (torch.arange(10.0 * P) * total)[rank * 10 : (rank + 1) * 10]),
        all(w.is_completed() and w.is_success() for w in works),
    ]
    gpucomm.destroy_process_group()
    return ok, issued


@pytest.mark.parametrize("path", ["gloo", "default"])
def test_works_in_flight_complete_with_correct_results(path: str) -> None:
    results = run_ranks(_in_flight, 3, GLOO if path == "gloo" else {}, timeout=120)
    for rank, (ok, issued) in enumerate(results):
        assert all(ok), f"{path}, rank {rank}: {ok}"
        if path == "gloo" and rank < 2:
            # Four calls issued while the last rank sleeps: none of them waited for it.
            assert issued < 0.4, f"rank {rank}: issuing four async calls took {issued:.2f} s"


def _is_completed_and_future(rank: int, world_size: int) -> dict:
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=60, **GLOO)
    if rank == 1:
        time.sleep(1.0)
    t = torch.full((16,), float(rank + 1))
    work = gpucomm.all_reduce(t, async_op=True)
    start = time.monotonic()
    first = work.is_completed()
    asked = time.monotonic() - start
    doubled = work.get_future().then(lambda fut: fut.value()[0] * 2)
    value = doubled.wait()
    seen = {"first": first, "asked_s": asked, "chained": value.tolist(), "completed": work.is_completed()}
    gpucomm.destroy_process_group()
    return seen


def test_is_completed_never_blocks_and_futures_chain() -> None:
    seen = run_ranks(_is_completed_and_future, 2, timeout=120)
    assert seen[0]["first"] is False and seen[0]["asked_s"] < 0.05, seen[0]
    for s in seen:
        assert s["chained"] == [6.0] * 16 and s["completed"], s


def _ddp_hook_overlap(rank: int, world_size: int, tmp: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import gpucomm
    from gpucomm.ddp import GpucommState, allreduce_hook

    def train(hook: bool) -> tuple[dict[str, torch.Tensor], list[bool]]:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/{'hook' if hook else 'plain'}", rank=rank, world_size=world_size
        )
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
        done_on_return: list[bool] = []
        if hook:
            state = GpucommState(dist.group.WORLD)  # GPUCOMM_TRANSPORT=gloo: on gloo's threads

            def watched(state_, bucket):  # noqa: ANN001, ANN202 (DDP checks annotations as objects)
                fut = allreduce_hook(state_, bucket)
                done_on_return.append(fut.done())
                return fut

            watched.__name__ = "gpucomm_allreduce_hook_watched"
            ddp.register_comm_hook(state, watched)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            loss = ddp(torch.randn(32, 64, generator=gen)).square().mean()
            if rank == 1:
                time.sleep(0.3)  # rank 1 is late: rank 0's buckets wait for it
            loss.backward()
            opt.step()
            opt.zero_grad()
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if hook:
            state.close()
        dist.destroy_process_group()
        return params, done_on_return

    plain, _ = train(hook=False)
    hooked, done = train(hook=True)
    worst = max(((hooked[k] - plain[k]).abs().max() / plain[k].abs().max()).item() for k in plain)
    del gpucomm
    return {"done_on_return": done, "worst_rel_diff": worst}


def test_ddp_hook_returns_before_the_bucket_is_reduced(tmp_path) -> None:
    results = run_ranks(_ddp_hook_overlap, 2, str(tmp_path), env={"GPUCOMM_TRANSPORT": "gloo"}, timeout=240)
    # Rank 0 runs ahead: its hooks return Futures that rank 1 has not let complete yet.
    assert results[0]["done_on_return"] and not all(results[0]["done_on_return"]), results[0]
    for r in results:
        # Dividing after the sum instead of before moves the last bit at most (docs/ddp.md).
        assert r["worst_rel_diff"] < 1e-6, r


def _dies_while_the_other_computes(rank: int, world_size: int) -> dict:
    import io
    import logging

    import torch

    import gpucomm

    stream = io.StringIO()
    logging.getLogger("gpucomm").addHandler(logging.StreamHandler(stream))
    gpucomm.init_process_group(timeout=3, **GLOO)
    gpucomm.all_reduce(torch.ones(4))
    if rank == 1:
        time.sleep(1.0)  # rank 0's next call is under way: it cannot fail before it starts
        os.kill(os.getpid(), signal.SIGKILL)
    comm = gpucomm.get_default_communicator()
    gpucomm.all_reduce(torch.ones(4), async_op=True)
    # Busy with something else, calling nothing of gpucomm's: the watchdog finds the failure.
    start, spins = time.monotonic(), 0
    while time.monotonic() - start < 9.0:
        spins += 1
    broken = repr(comm._broken)
    try:
        gpucomm.all_reduce(torch.ones(4))
        later = "no error"
    except gpucomm.CommBrokenError as err:
        later = repr(err.__cause__)
    return {"broken": broken, "log": stream.getvalue(), "later": later}


def test_watchdog_names_a_dead_peer_while_the_caller_is_busy() -> None:
    results = run_ranks(_dies_while_the_other_computes, 2, allow_exit=(1,), timeout=120)
    seen = results[0]
    # gloo hears the dead peer's connection close: a PeerLostError (a CommTimeoutError) saying it is gone
    assert "PeerLostError" in seen["broken"] and "[1]" in seen["broken"], seen
    assert "its process is gone" in seen["broken"], seen
    watchdog_lines = [line for line in seen["log"].splitlines() if "watchdog" in line]
    assert len(watchdog_lines) == 1 and "rank(s) [1]" in watchdog_lines[0], seen["log"]
    assert "PeerLostError" in seen["later"] and "[1]" in seen["later"], seen


def _wait_with_a_timeout(rank: int, world_size: int) -> str:
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=20, **GLOO)
    if rank == 1:
        time.sleep(3.0)
        try:
            gpucomm.all_reduce(torch.ones(4))
        except gpucomm.GpucommError as err:  # rank 0 gave up on this call
            return type(err).__name__
        return "completed"
    work = gpucomm.all_reduce(torch.ones(4), async_op=True)
    start = time.monotonic()
    try:
        work.wait(timeout=0.5)
    except gpucomm.CommTimeoutError:
        return f"timed out after {time.monotonic() - start:.1f} s"
    return "no timeout"


def test_wait_with_a_timeout_raises_in_time() -> None:
    from gpucomm.reliability.liveness import GRACE_S

    results = run_ranks(_wait_with_a_timeout, 2, timeout=120)
    # The 0.5 s of the wait, then the grace in which live peers may report the same call failed
    # (which names the late rank rather than every peer).
    assert results[0].startswith("timed out after") and float(results[0].split()[3]) < 0.5 + GRACE_S + 1.5, results


_ABORTS = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import gpucomm

    gpucomm.init_process_group(transport="gloo", timeout=2, async_error_handling="abort")
    gpucomm.all_reduce(torch.ones(2))
    if os.environ["RANK"] == "1":
        time.sleep(1.0)  # rank 0's next call is under way: it fails in the background
        os._exit(0)
    gpucomm.all_reduce(torch.ones(2), async_op=True)
    time.sleep(30)
    print("still alive")
    """
)


def test_async_error_handling_abort_ends_the_process(tmp_path) -> None:
    script = tmp_path / "aborts.py"
    script.write_text(_ABORTS)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUCOMM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={
                **base,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    start = time.monotonic()
    out, err = procs[0].communicate(timeout=60)
    procs[1].communicate(timeout=60)
    assert procs[0].returncode == -signal.SIGABRT, (procs[0].returncode, out, err[-2000:])
    assert time.monotonic() - start < 2 + 5 + 15, "the abort came too late"
    assert "watchdog" in err and "still alive" not in out, err[-2000:]


# -- the shared-memory workspace: asynchronous calls on the communicator's progress thread --------

SHM = {"transport": "shm"}


def _host_async(rank: int, world_size: int) -> dict:
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=60, **SHM)
    n = 1 << 20
    if rank == 1:
        time.sleep(1.0)  # rank 0's calls cannot complete before this rank joins
    x = torch.full((n,), float(rank + 1))
    h = torch.full((1001,), float(rank + 1), dtype=torch.float16)  # staged: written back on completion
    work = gpucomm.all_reduce(x, async_op=True)
    returned_pending = not work.is_completed()
    half = gpucomm.all_reduce(h, op=gpucomm.ReduceOp.MAX, async_op=True)
    future = half.get_future()
    # A blocking call behind pending asynchronous ones runs after them, in call order on every rank.
    b = torch.full((7,), float(rank))
    gpucomm.broadcast(b, src=1)
    done_after_blocking = work.is_completed() and half.is_completed()
    work.wait()
    result = future.wait()
    seen = {
        "returned_pending": returned_pending,
        "done_after_blocking": done_after_blocking,
        "sum": torch.equal(x, torch.full((n,), 3.0)),
        "future": result[0] is h and torch.equal(h, torch.full((1001,), 2.0, dtype=torch.float16)),
        "broadcast": torch.equal(b, torch.full((7,), 1.0)),
        "thread": [t.name for t in __import__("threading").enumerate() if t.name.startswith("gpucomm-progress")],
    }
    gpucomm.destroy_process_group()
    seen["threads_after_destroy"] = [
        t.name for t in __import__("threading").enumerate() if t.name.startswith("gpucomm-progress")
    ]
    return seen


def test_async_calls_on_shared_memory_return_at_once_and_complete_in_order() -> None:
    results = run_ranks(_host_async, 2, timeout=120)
    # Rank 0 called first: its call was still waiting for rank 1 when it returned.
    assert results[0]["returned_pending"], results[0]
    for rank, seen in enumerate(results):
        assert seen["done_after_blocking"] and seen["sum"] and seen["future"] and seen["broadcast"], (rank, seen)
        assert seen["thread"] == [f"gpucomm-progress-r{rank}"] and seen["threads_after_destroy"] == [], (rank, seen)


def _host_async_errors(rank: int, world_size: int, case: str) -> str:
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=2, **SHM)
    if case == "mismatch":
        work = gpucomm.all_reduce(torch.ones(8 if rank == 0 else 16), async_op=True)
    else:  # timeout: rank 1 never calls
        if rank == 1:
            time.sleep(4.0)
            return "absent"
        work = gpucomm.all_reduce(torch.ones(8), async_op=True)
    try:
        work.wait()
        first = "no error"
    except gpucomm.GpucommError as err:
        first = type(err).__name__
    try:
        gpucomm.all_reduce(torch.ones(8))
        later = "no error"
    except gpucomm.GpucommError as err:
        later = type(err).__name__
    return f"{first} then {later}"


@pytest.mark.parametrize("case", ["mismatch", "timeout"])
def test_async_calls_on_shared_memory_raise_as_blocking_ones(case: str) -> None:
    results = run_ranks(_host_async_errors, 2, case, timeout=120)
    expected = "CommMismatchError" if case == "mismatch" else "CommTimeoutError"
    assert results[0] == f"{expected} then CommBrokenError", results


def _send_beside_async_collectives(rank: int, world_size: int, rounds: int) -> list[str]:
    """A large send/recv in flight (many mailbox pieces) while asynchronous all_reduces run on the
    progress thread, whose waits move the mailboxes too, and the caller's wait() moves them."""
    import torch

    import gpucomm

    # A small workspace: the mailboxes hold a few KiB, so the message moves in hundreds of pieces.
    gpucomm.init_process_group(timeout=60, transport="shm", workspace_bytes=64 << 10)
    wrong = []
    for r in range(rounds):
        message = torch.arange(1 << 18, dtype=torch.float32) * (r + 1)
        received = torch.full_like(message, -1.0)
        p2p = gpucomm.isend(message, 1) if rank == 0 else gpucomm.irecv(received, 0)
        xs = [torch.full((4096,), float(rank + i)) for i in range(8)]
        works = [gpucomm.all_reduce(x, async_op=True) for x in xs]
        p2p.wait()
        for work in works:
            work.wait()
        if rank == 1 and not torch.equal(received, message):
            wrong.append(f"round {r}: message differs at {(received != message).nonzero()[:3].flatten().tolist()}")
        for i, x in enumerate(xs):
            if not torch.equal(x, torch.full((4096,), float(2 * i + 1))):
                wrong.append(f"round {r}: all_reduce {i} wrong")
    gpucomm.destroy_process_group()
    return wrong


def test_send_recv_beside_async_collectives_on_shared_memory() -> None:
    assert run_ranks(_send_beside_async_collectives, 2, 5, timeout=240) == [[], []]
