"""destroy_process_group gives everything back before it returns (gpucomm/comm/communicator.py).

- Every workspace segment is unmapped and its /dev/shm memory free when destroy returns, whatever
  Works the caller holds, with Python's cyclic garbage collector off: 10 init/destroy cycles run
  in a /dev/shm that holds one job (a private mount namespace with a small tmpfs), under
  GPUCOMM_TRANSPORT=shm and under auto, which must stay on the workspace (no fallback to gloo).
  Before, the workspace stayed mapped until the collector ran: the second init failed (shm) or
  went to gloo (auto).
- The one exception: a symmetric heap whose tensors the caller holds stays, readable, until the
  last of them is freed.
- Works of asynchronous calls still queued at destroy end with the error recorded for them (a
  typed GpucommError), not a ValueError of a released buffer, and keep nothing of the closed
  communicator alive: it is freed once the caller drops it, Works held or not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from private_shm import namespace_refused
from spawn import run_ranks

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "scripts", "shm_cycles.py"
)
RUN_S = 300
# Two ranks' workspaces are 2 x 11 MiB and their flight records 80 KiB: 34 MiB holds one job,
# not two.
ONE_JOB = "34M"


@pytest.mark.parametrize("transport", ["shm", "auto"])
def test_ten_init_destroy_cycles_fit_a_dev_shm_of_one_job(transport: str) -> None:
    refused = namespace_refused()
    if refused:
        pytest.skip(refused)
    command = f'mount -t tmpfs -o size={ONE_JOB} tmpfs /dev/shm && exec "$0" "$@"'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", command, sys.executable, SCRIPT, transport, "10", "2"],
        capture_output=True,
        text=True,
        timeout=RUN_S,
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}:\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for rank, cycles in enumerate(report["results"]):
        assert len(cycles) == 10
        for n, got in enumerate(cycles):
            assert got["path"] == "workspace transport=shm kernels=torch", (rank, n, got)
            assert got["right"] and got["warnings"] == [], (rank, n, got)
            assert got["mapped"] == 0, f"rank {rank} cycle {n}: {got['mapped']} segment mapping(s) left after destroy"
    assert report["left"] == [], f"left in /dev/shm: {report['left']}"


def _mapped() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if "/dev/shm/gpucomm_" in line)


def _rank_heap_outlives_destroy(rank, world_size):
    import gc

    import torch

    import gpucomm

    gc.disable()
    gpucomm.init_process_group(timeout=30, transport="shm")
    x = gpucomm.empty(1000)
    x.copy_(torch.arange(1000.0) + rank)
    gpucomm.all_reduce(x)
    gpucomm.destroy_process_group()
    kept = _mapped()  # the heap's own segment and its peer's, for the tensor held
    right = bool((x == 2 * torch.arange(1000.0) + 1).all())
    del x
    gc.collect()
    return kept, right, _mapped()


def test_a_held_symmetric_tensor_keeps_the_heap_until_it_is_freed():
    for kept, right, after in run_ranks(_rank_heap_outlives_destroy, 2, timeout=120):
        assert kept == 2 and right, (kept, right)
        assert after == 0


def _wait_count(store, key, count):
    import time

    while store.add(key, 0) < count:
        time.sleep(0.01)


def _rank_destroy_with_queued_work(rank, world_size, transport):
    import gc
    import weakref

    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=3, transport=transport)
    comm = weakref.ref(gpucomm.get_default_communicator())
    tensors = [torch.full((1 << 14,), float(rank)) for _ in range(4)]
    works = [gpucomm.all_reduce(t, async_op=True) for t in tensors]
    store = gpucomm.get_default_communicator().store
    store.add("queued", 1)  # both ranks queue every call before either destroys
    _wait_count(store, "queued", 2)
    gpucomm.destroy_process_group()
    ended = []
    for work in works:
        done = work.is_completed()
        try:
            work.wait()
            ended.append((done, None, ""))
        except Exception as exc:  # noqa: BLE001 - the test reports what each Work raised
            ended.append((done, type(exc).__name__, str(exc)))
    gc.collect()
    return ended, comm() is None, _mapped()


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_destroy_with_queued_async_work_ends_each_work_typed_and_frees_the_communicator(transport):
    import gpucomm

    typed = {name for name in dir(gpucomm.errors) if isinstance(getattr(gpucomm.errors, name), type)}
    for rank, (ended, freed, mapped) in enumerate(run_ranks(_rank_destroy_with_queued_work, 2, transport, timeout=120)):
        for done, error, message in ended:
            assert done, (rank, ended)
            assert error is None or error in typed, (rank, error, message)
        assert freed, f"rank {rank}: the closed communicator is still alive (the Works held keep it)"
        assert mapped == 0, (rank, mapped)
