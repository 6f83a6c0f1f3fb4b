"""The GPU heap's driver calls (gpucomm/transport/vmm.py, multicast.py) on the driver double, across processes.

Each rank is a fresh process whose ``libcuda.so.1`` is the double (tests/support/cuda_double, with its
vmm.c), reached through cuda.bindings as on a GPU; every rank records into one log, in the
order the calls happen. The double backs allocations with memfds and maps them for real, so the
heap's descriptors, passed between the ranks over Unix sockets, must map the same bytes: a value
one rank writes into its heap is read by the other through its mapping of it.

The multicast set-up must keep the driver's order: rank 0 alone creates the object, every rank
imports it, every rank adds its device before any rank binds memory (the double refuses a bind
before that, as the driver does), and the creator releases its handle only after every rank
has bound.
"""

from __future__ import annotations

import re

import pytest
from vmm_ranks import WORLD, run_heap_ranks

pytest.importorskip("cuda.bindings", reason="cuda.bindings is the optional vmm extra")


def test_heap_is_shared_and_multicast_set_up_keeps_the_drivers_order(tmp_path) -> None:
    outs, calls = run_heap_ranks(tmp_path, "kept")
    for rank, (code, _, err) in enumerate(outs):
        assert code == 0, f"rank {rank}:\n{err[-4000:]}"
    calls = [c for c in calls if c.entry not in ("cuGetProcAddress",)]
    by_pid: dict[str, list] = {}
    for c in calls:
        if "pid" in c:
            by_pid.setdefault(c["pid"], []).append(c)
    assert len(by_pid) == WORLD
    # Every rank's heap: one allocation of 4 MiB, exported once, imported by the other rank.
    created = [c for c in calls if c.entry == "cuMemCreate"]
    assert sorted(c["size"] for c in created) == [str(4 << 20)] * WORLD
    imported = [c for c in calls if c.entry == "cuMemImportFromShareableHandle" and c["multicast"] == "0"]
    assert {(c["pid"], c["inode"]) for c in imported} == {
        (other["pid"], mine["inode"]) for mine in created for other in created if other["pid"] != mine["pid"]
    }
    # The multicast object: created once, imported by every other rank, the same object everywhere.
    (create,) = [i for i, c in enumerate(calls) if c.entry == "cuMulticastCreate"]
    creator, mc = calls[create]["pid"], calls[create]["inode"]
    assert calls[create]["devices"] == str(WORLD)
    mc_imports = [c for c in calls if c.entry == "cuMemImportFromShareableHandle" and c["multicast"] == "1"]
    assert sorted(c["pid"] for c in mc_imports) == sorted(p for p in by_pid if p != creator)
    assert all(c["inode"] == mc for c in mc_imports)
    adds = [i for i, c in enumerate(calls) if c.entry == "cuMulticastAddDevice"]
    binds = [i for i, c in enumerate(calls) if c.entry == "cuMulticastBindMem"]
    assert len(adds) == WORLD and len(binds) == WORLD
    assert all("refused" not in calls[i] for i in binds)
    assert max(adds) < min(binds), "a rank bound memory before every device was added"
    assert create < min(adds)
    # Each rank binds its own heap.
    assert {(calls[i]["pid"], calls[i]["mem"]) for i in binds} == {(c["pid"], c["inode"]) for c in created}
    # Every release of the multicast object, the creator's first of all, comes after every bind.
    releases = [i for i, c in enumerate(calls) if c.entry == "cuMemRelease" and c["multicast"] == "1"]
    assert len(releases) == WORLD
    assert min(releases) > max(binds)
    assert all(calls[i]["bound"] == str(WORLD) for i in releases)
    # Each rank unmaps and unbinds the object before it releases it.
    for own in by_pid.values():
        entries = [(c.entry, c.get("multicast")) for c in own]
        release = entries.index(("cuMemRelease", "1"))
        assert entries.index(("cuMulticastUnbind", None)) < release, entries


def test_the_double_refuses_a_bind_before_every_device_is_added(tmp_path) -> None:
    outs, calls = run_heap_ranks(tmp_path, "early")
    assert outs[1][0] == 0, outs[1][2][-4000:]
    assert "bind before add: 800" in outs[1][1]  # CUDA_ERROR_NOT_PERMITTED
    refused = [c for c in calls if c.entry == "cuMulticastBindMem" and c.get("refused") == "1"]
    assert refused and refused[0]["added"] in ("0", "1")


def test_the_engines_path_shares_the_heap_and_names_why_there_is_no_multicast(tmp_path) -> None:
    """heap_open, as the engine opens a GPU's heap: VMM agreed on by every rank, the heap shared,
    and, with every rank on one GPU, no multicast object and the reason every rank gets."""
    outs, calls = run_heap_ranks(tmp_path, "engine")
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0, f"rank {rank}:\n{err[-4000:]}"
        assert "kind: ('vmm', '')" in out, out
        assert "multicast: None why: rank 0: ranks share a GPU (UUID 60616263...)" in out, out
    assert not [c for c in calls if c.entry.startswith("cuMulticast")]
    # Two heaps per rank (the test's own, then the engine path's), each imported by the other rank.
    assert len([c for c in calls if c.entry == "cuMemImportFromShareableHandle"]) == 2 * WORLD


# Each rank a GPU of its own: the double's UUID per process.
OWN_GPUS = {r: {"DRIVER_DOUBLE_GPU_UUID": f"{r + 1:02x}" * 16} for r in range(WORLD)}


def test_the_engines_path_binds_a_heap_sized_to_the_multicast_granularity(tmp_path) -> None:
    """A GPU per rank: the multicast object is made, and the heap (3 MiB asked, 2 MiB allocation
    granularity) is a multiple of the minimum multicast granularity: 4 MiB, not the recommended
    8 MiB's multiple the set-up once demanded (and, with the heap at 4 MiB, refused)."""
    outs, calls = run_heap_ranks(tmp_path, "engine", OWN_GPUS)
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0, f"rank {rank}:\n{err[-4000:]}"
        assert f"multicast: made why:  size: {4 << 20}" in out, out
    assert len([c for c in calls if c.entry == "cuMulticastBindMem" and "refused" not in c]) == WORLD


@pytest.mark.parametrize("failing_rank, entry", [(0, "cuMulticastCreate"), (1, "cuMulticastBindMem")])
def test_a_multicast_call_failing_on_one_rank_leaves_every_rank_the_heap_and_the_reason(
    tmp_path, failing_rank, entry
) -> None:
    """The driver refuses one rank's part of the multicast set-up: every rank goes on with the heap
    alone, names that rank's reason, and releases what it made of the object, within the test's
    time (not the 30 s a peer would wait for a barrier the failing rank never reaches)."""
    env = {r: dict(e) for r, e in OWN_GPUS.items()}
    env[failing_rank]["DRIVER_DOUBLE_FAIL"] = entry
    outs, calls = run_heap_ranks(tmp_path, "engine", env)
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0, f"rank {rank}:\n{err[-4000:]}"
        assert (
            f"multicast: None why: rank {failing_rank}: gpucomm symmetric heap: {entry} failed: "
            "CUDA_ERROR_OUT_OF_MEMORY" in out
        ), out
    multicast_releases = [c for c in calls if c.entry == "cuMemRelease" and c.get("multicast") == "1"]
    made = [c for c in calls if c.entry == "cuMulticastCreate"] + [
        c for c in calls if c.entry == "cuMemImportFromShareableHandle" and c.get("multicast") == "1"
    ]
    assert len(multicast_releases) == len(made)  # every handle made of the object is released


def test_the_heap_opens_and_releases_on_its_gpu_whatever_context_the_thread_holds(tmp_path) -> None:
    """A thread holding another GPU's context (a process driving several GPUs; a release run by
    whichever thread drops the last tensor): the heap's calls run in its own GPU's primary
    context (the double's memset refuses any other, as the driver's would fault), and the
    thread's context is its own again after."""
    outs, calls = run_heap_ranks(tmp_path, "other_context")
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0, f"rank {rank}:\n{err[-4000:]}"
        assert "context after open and release: device 1" in out, out
    pushes = [c for c in calls if c.entry == "cuCtxPushCurrent"]
    assert pushes and {c["device"] for c in pushes} == {"0"}


@pytest.mark.parametrize("failing_rank, entry", [(0, "cuMemCreate"), (1, "cuMemImportFromShareableHandle")])
def test_a_heap_the_driver_refuses_on_one_rank_is_refused_on_every_rank_at_once(tmp_path, failing_rank, entry) -> None:
    """A rank's driver refuses its part of the heap (no memory; an import it cannot take, as an
    MPS client might): every rank raises VmmHeapRefused naming that rank, at the same step and
    at once, not after the 30 s its peers would wait for a descriptor, and the engine then takes
    a heap of its own (gpucomm.workspace.engine.Engine.open_heap)."""
    env = {r: dict(e) for r, e in OWN_GPUS.items()}
    env[failing_rank]["DRIVER_DOUBLE_FAIL"] = entry
    outs, calls = run_heap_ranks(tmp_path, "engine_refused", env)
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0, f"rank {rank}:\n{err[-4000:]}"
        match = re.search(
            r"refused after ([\d.]+) s: rank (\d): gpucomm symmetric heap: (\w+) failed: CUDA_ERROR_OUT_OF_MEMORY", out
        )
        assert match and (int(match[2]), match[3]) == (failing_rank, entry), out
        assert float(match[1]) < 10, out
    made = [c for c in calls if c.entry in ("cuMemCreate", "cuMemImportFromShareableHandle")]
    released = [c for c in calls if c.entry == "cuMemRelease"]
    assert len(released) == len(made)  # every handle made is released


def test_a_release_step_the_driver_refuses_does_not_stop_the_others(tmp_path) -> None:
    """Every unmap refused: the range is still freed and every handle released (the heap is GiBs
    of device memory), and the first refusal is raised after."""
    outs, calls = run_heap_ranks(
        tmp_path, "release_fails", {r: {"DRIVER_DOUBLE_FAIL": "cuMemUnmap"} for r in range(WORLD)}
    )
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0, f"rank {rank}:\n{err[-4000:]}"
        assert "release raised: gpucomm symmetric heap: cuMemUnmap failed: CUDA_ERROR_OUT_OF_MEMORY" in out, out
    made = [c for c in calls if c.entry in ("cuMemCreate", "cuMemImportFromShareableHandle")]
    assert len([c for c in calls if c.entry == "cuMemRelease"]) == len(made) == 2 * WORLD
    assert len([c for c in calls if c.entry == "cuMemAddressFree"]) == WORLD
