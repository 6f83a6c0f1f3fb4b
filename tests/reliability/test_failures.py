"""No hang, a named culprit, mismatches caught, nothing leaked: on the gloo path, the shm
workspace path with the torch kernels, and the shm workspace path with the Triton program kernel
under the interpreter (two channels), where every wait happens inside the kernel (the cuda_ipc
versions live in tests/gpu)."""

from __future__ import annotations

import gc
import os
import random
import time

import pytest
from spawn import run_ranks

PATHS = {
    "gloo": {"transport": "gloo"},
    "shm": {"transport": "shm", "kernels": "torch"},
    "triton": {"transport": "shm", "kernels": "triton", "channels": 2},
}
# The interpreter must be on before triton is imported: the harness sets it in each rank.
ENV = {"triton": {"TRITON_INTERPRET": "1"}}
# The interpreter runs a launch in tens of milliseconds: fewer calls for the loops on it.
SHARE = {"gloo": 1, "shm": 1, "triton": 10}


def _meet(knobs: dict) -> None:
    """Meet the other ranks once under a generous deadline, then part (as test_hang_story's
    _meet): the store outlives the group, so a short-deadline group built next starts with every
    rank there. On a loaded machine a rank's first connect to rank 0's store could outlast a 4 s
    deadline while rank 0 was still importing (seen once in 40 runs at a load average of 23)."""
    import gpucomm

    gpucomm.init_process_group(timeout=60, **knobs)
    gpucomm.barrier()
    gpucomm.destroy_process_group()


def _killed_peer(rank: int, world_size: int, knobs: dict, victim: int, when: str, timeout: float) -> float | None:
    import signal
    import threading

    import torch

    import gpucomm

    _meet(knobs)
    gpucomm.init_process_group(timeout=timeout, **knobs)
    t = torch.ones(1 << 16)
    gpucomm.all_reduce(t)
    if rank == victim:
        if when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGKILL)).start()
    start = time.monotonic()
    try:
        for _ in range(100000):
            gpucomm.all_reduce(t)
    except gpucomm.CommTimeoutError as err:
        elapsed = time.monotonic() - start
        assert victim in err.missing and rank not in err.missing, str(err)
        if knobs["transport"] == "gloo" or knobs.get("kernels") == "torch":
            # gloo hears the connection close, the host executor's waits see the process gone
            # (gpucomm.reliability.lost): the peer is said lost, within a second or so
            assert isinstance(err, gpucomm.PeerLostError) and f"rank {rank} lost rank(s) [1]" in str(err), str(err)
        else:  # a blocking call's wait inside the program kernel ends at the timeout
            assert f"rank {rank} timed out" in str(err), str(err)
        with pytest.raises(gpucomm.CommBrokenError):
            gpucomm.all_reduce(t)
        gpucomm.destroy_process_group()
        return elapsed
    raise AssertionError("the collectives went on with a dead peer")


@pytest.mark.parametrize("when", ["before", "during"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_killed_rank_is_named_within_timeout_plus_5s(path: str, when: str) -> None:
    timeout = 4.0
    results = run_ranks(_killed_peer, 3, PATHS[path], 1, when, timeout, allow_exit=(1,), timeout=120, env=ENV.get(path))
    for rank in (0, 2):
        assert results[rank] is not None and results[rank] <= timeout + 5, f"rank {rank}: {results[rank]}"


def _slow_peer(rank: int, world_size: int, knobs: dict) -> list[float]:
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=10, **knobs)
    if rank == 2:
        time.sleep(2.5)
    t = torch.full((1000,), float(rank))
    gpucomm.all_reduce(t)
    gpucomm.destroy_process_group()
    return sorted(set(t.tolist()))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_slow_peer_within_timeout_gives_the_right_result(path: str) -> None:
    assert run_ranks(_slow_peer, 3, PATHS[path], env=ENV.get(path)) == [[3.0]] * 3


def _mismatch(rank: int, world_size: int, knobs: dict, kind: str) -> str:
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=20, **knobs)
    t = torch.ones(10 + (rank if kind == "size" else 0))
    try:
        if kind == "collective" and rank == 1:
            gpucomm.barrier()
        elif kind == "op":
            gpucomm.all_reduce(t, op=gpucomm.ReduceOp.SUM if rank == 0 else gpucomm.ReduceOp.MAX)
        elif kind == "dtype":
            gpucomm.all_reduce(t if rank == 0 else t.double())
        elif kind == "root":
            gpucomm.broadcast(t, src=rank)
        else:
            gpucomm.all_reduce(t)
    except gpucomm.CommMismatchError as err:
        with pytest.raises(gpucomm.CommBrokenError):
            gpucomm.all_reduce(t)
        gpucomm.destroy_process_group()
        # A fresh group works again.
        gpucomm.init_process_group(timeout=20, **knobs)
        again = torch.ones(3)
        gpucomm.all_reduce(again)
        gpucomm.destroy_process_group()
        assert again.tolist() == [2.0] * 3
        return str(err)
    raise AssertionError(f"no mismatch detected for {kind}")


@pytest.mark.parametrize("kind", ["size", "op", "dtype", "collective", "root"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_mismatched_calls_raise_on_every_rank(path: str, kind: str) -> None:
    messages = run_ranks(_mismatch, 2, PATHS[path], kind, timeout=120, env=ENV.get(path))
    for rank, message in enumerate(messages):
        assert f"rank {rank}" in message and "different" in message, message


def _resource_counts() -> tuple[int, int, int]:
    """(open files, RSS, /dev/shm entries this process made). Only its own entries (their names
    carry its pid): other test runs on the machine have segments of their own there for a moment.
    Collected first: a closed workspace's mapping (and the descriptor Python's mmap keeps with it)
    goes when the last view of it does, at a collection whose moment other allocations decide."""
    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    shm = len([n for n in os.listdir("/dev/shm") if n.startswith("gpucomm") and f"_{os.getpid():x}_" in n])
    return fds, rss_pages * os.sysconf("SC_PAGE_SIZE"), shm


def _init_close_loop(rank: int, world_size: int, knobs: dict, rounds: int) -> list[tuple[int, int, int]]:
    import torch

    import gpucomm

    counts = []
    for i in range(rounds):
        gpucomm.init_process_group(timeout=30, **knobs)
        t = torch.ones(100)
        gpucomm.all_reduce(t)
        gpucomm.destroy_process_group()
        if i in (rounds // 5, rounds - 1):  # after a warm-up fifth, and at the end
            counts.append(_resource_counts())
    return counts


@pytest.mark.parametrize("path", sorted(PATHS))
def test_init_close_100_times_leaks_nothing(path: str) -> None:
    for warm, end in run_ranks(_init_close_loop, 2, PATHS[path], 100 // SHARE[path], timeout=300, env=ENV.get(path)):
        assert end[0] <= warm[0], f"open files grew from {warm[0]} to {end[0]}"
        assert end[2] == 0, f"{end[2]} gpucomm entries left in /dev/shm"
        # Allocator noise stays within a few MiB; a leaked 8 MiB workspace per round would not.
        assert end[1] - warm[1] < 24 << 20, f"RSS grew by {(end[1] - warm[1]) >> 20} MiB"


def _soak(
    rank: int, world_size: int, knobs: dict, calls: int
) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=30, **knobs)
    t = torch.empty(64)
    wrong = 0
    for i in range(calls):
        t.fill_(float(rank + i % 7))
        gpucomm.all_reduce(t)
        wrong += int(t[0].item() != world_size * (i % 7) + world_size * (world_size - 1) / 2)
        if i == calls // 10:
            warm = _resource_counts()
    end = _resource_counts()
    gpucomm.destroy_process_group()
    return warm, end, wrong


def _soak_calls(request: pytest.FixtureRequest) -> int:
    return 10_000 if request.config.getoption("--run-slow") else 2_000


@pytest.mark.parametrize("path", ["shm", "triton"])
def test_soak_small_all_reduces(path: str, request: pytest.FixtureRequest) -> None:
    calls = _soak_calls(request) // SHARE[path]
    for warm, end, wrong in run_ranks(_soak, 3, PATHS[path], calls, timeout=600, env=ENV.get(path)):
        assert wrong == 0
        assert end[0] <= warm[0] and end[1] - warm[1] < 8 << 20, (warm, end)


def _fuzz(rank: int, world_size: int, knobs: dict, seed: int, calls: int) -> tuple[list[str], list[str]]:
    import torch
    from collective_matrix import DTYPES, OPS, Matrix

    import gpucomm

    gpucomm.init_process_group(timeout=60, **knobs)
    rng = random.Random(seed)  # the same sequence of calls on every rank
    m = Matrix(seed)
    for _ in range(calls):
        n = rng.choice([0, 1, 2, 7, 64, 129, 1000, 4099])
        dtype = rng.choice(DTYPES)
        op = rng.choice(OPS)
        kind = rng.randrange(9)
        if kind == 0:
            m.all_reduce(n, dtype, op, async_op=rng.random() < 0.3)
        elif kind == 1:
            m.reduce(n, dtype, op)
        elif kind == 2:
            m.reduce_scatter(n, dtype, op, rng.choice(["list", "tensor", "single"]))
        elif kind == 3:
            m.broadcast(n, dtype)
        elif kind == 4:
            m.all_gather(n, dtype, rng.choice(["list", "tensor", "single"]))
        elif kind == 5:
            (m.gather if rng.random() < 0.5 else m.scatter)(n, dtype)
        elif kind == 6:
            m.all_to_all(n, dtype, rng.choice(["list", "single"]))
        elif kind == 7:
            m.send_recv(n, dtype)
        else:
            m.barrier()
    gpucomm.destroy_process_group()
    del torch
    return m.failures, m.digests


@pytest.mark.parametrize("path", sorted(PATHS))
def test_fuzz_random_collectives(path: str, request: pytest.FixtureRequest) -> None:
    seed = random.randrange(1 << 30)
    calls = (10000 if request.config.getoption("--run-slow") else 1500) // SHARE[path]
    results = run_ranks(_fuzz, 3, PATHS[path], seed, calls, timeout=600, env=ENV.get(path))
    failures = [f for fails, _ in results for f in fails]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:30])
    assert all(d == results[0][1] for _, d in results), f"seed {seed}: all_reduce results differ between ranks"


def _store_listener(rank: int, world_size: int) -> list[str]:
    import gpucomm

    gpucomm.init_process_group()
    port = int(os.environ["MASTER_PORT"])
    listeners = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and int(local.split(":")[1], 16) == port:
                    listeners.append(local.split(":")[0])
    prefix = gpucomm.get_default_communicator().prefix
    gpucomm.destroy_process_group()
    return listeners + [prefix]


def test_store_listens_on_loopback_only_and_keys_carry_a_random_prefix() -> None:
    first = run_ranks(_store_listener, 1)[0]
    second = run_ranks(_store_listener, 1)[0]
    assert first[:-1] == ["0100007F"], f"listening addresses (hex): {first[:-1]}"
    assert first[-1] != second[-1] and first[-1].startswith("gpucomm/"), (first[-1], second[-1])
