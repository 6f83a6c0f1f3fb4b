"""The GPU heap's driver calls (gpucomm/transport/vmm.py) on the driver double, across processes.

Each rank is a fresh process whose ``libcuda.so.1`` is the double (tests/cuda_double, with its
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

import os
import subprocess
import sys
import textwrap

import pytest

import cuda_double
from spawn import free_port

pytest.importorskip("cuda.bindings", reason="cuda.bindings is the optional vmm extra")

WORLD = 2
HEAP = 3 << 20  # rounded up to the double's 2 MiB granularity: 4 MiB per rank

_RANK = """
import ctypes, sys, torch
from gpucomm.transport.fdpass import FdExchange
from gpucomm.transport import vmm

rank, world, port, nbytes, order = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timeout=__import__("datetime").timedelta(seconds=30))
assert vmm.vmm_unavailable(0) == "", vmm.vmm_unavailable(0)
assert vmm.multicast_unavailable([0]) == ""
assert "ranks share a GPU" in vmm.multicast_unavailable([0, 0])
exchange = FdExchange("test/", rank, world, timeout=30)
heap = vmm.open_vmm_heap(exchange, rank, world, 0, nbytes)
barrier = vmm.store_barrier(store, "test/", rank, world, timeout=30)
# The heap is shared: write this rank's number into its heap, read every rank's through its mapping.
ctypes.c_int64.from_address(heap.bases[rank] + 64).value = 1000 + rank
barrier("written")
seen = [ctypes.c_int64.from_address(base + 64).value for base in heap.bases]
assert seen == [1000 + p for p in range(world)], seen
assert ctypes.c_int64.from_address(heap.bases[rank]).value == 0  # zeroed at creation
if order == "engine":  # the engine's path (gpucomm.transport.heap_open): every rank on the double's one GPU
    from gpucomm.transport import heap_open
    heap.release()
    agreed = lambda mine: heap_open.agree(store, "engine/kind/", rank, world, 30, mine)
    print("kind:", heap_open.heap_kind(torch.device("cuda", 0), agreed))
    mapping, mc, release, why = heap_open.open_vmm_parts(store, "engine/", rank, world, 0, nbytes, 30)
    print("multicast:", mc, "why:", why)
    release()
    exchange.close()
    sys.exit(0)
if order == "kept":
    mc = vmm.bind_multicast(exchange, barrier, rank, world, heap)
    barrier("used")
    mc.release()
else:  # rank 1 binds before every device is added: the double refuses, as the driver does
    from cuda.bindings import driver
    posix_fd = driver.CUmemAllocationHandleType(1)
    if rank == 0:
        prop = driver.CUmulticastObjectProp()
        prop.numDevices, prop.handleTypes, prop.size = world, 1, heap.size
        _, handle = driver.cuMulticastCreate(prop)
        _, fd = driver.cuMemExportToShareableHandle(handle, posix_fd, 0)
        exchange.send([1], fd, 2)
        driver.cuMulticastAddDevice(handle, 0)
        barrier("done")
    else:
        fd = exchange.receive(1)[(0, 2)]
        _, handle = driver.cuMemImportFromShareableHandle(fd, posix_fd)
        err, = driver.cuMulticastBindMem(handle, 0, heap.own_handle, 0, heap.size, 0)
        print("bind before add:", int(err))
        barrier("done")
    driver.cuMemRelease(handle)
heap.release()
exchange.close()
"""


def _run(tmp_path, order: str) -> list:
    library = cuda_double.build()
    log = tmp_path / "calls.log"
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": os.path.dirname(library) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""),
        cuda_double.LOG_VARIABLE: str(log),
    }
    port = free_port()
    script = textwrap.dedent(_RANK)
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(r), str(WORLD), str(port), str(HEAP), order], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(WORLD)
    ]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    return outs, cuda_double.records(log)


def test_heap_is_shared_and_multicast_set_up_keeps_the_drivers_order(tmp_path) -> None:
    outs, calls = _run(tmp_path, "kept")
    for rank, (code, out, err) in enumerate(outs):
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
    for pid, own in by_pid.items():
        entries = [(c.entry, c.get("multicast")) for c in own]
        release = entries.index(("cuMemRelease", "1"))
        assert entries.index(("cuMulticastUnbind", None)) < release, entries


def test_the_double_refuses_a_bind_before_every_device_is_added(tmp_path) -> None:
    outs, calls = _run(tmp_path, "early")
    assert outs[1][0] == 0, outs[1][2][-4000:]
    assert "bind before add: 800" in outs[1][1]  # CUDA_ERROR_NOT_PERMITTED
    refused = [c for c in calls if c.entry == "cuMulticastBindMem" and c.get("refused") == "1"]
    assert refused and refused[0]["added"] in ("0", "1")


def test_the_engines_path_shares_the_heap_and_names_why_there_is_no_multicast(tmp_path) -> None:
    """heap_open, as the engine opens a GPU's heap: VMM agreed on by every rank, the heap shared,
    and, with every rank on one GPU, no multicast object and the reason every rank gets."""
    outs, calls = _run(tmp_path, "engine")
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0, f"rank {rank}:\n{err[-4000:]}"
        assert "kind: ('vmm', '')" in out, out
        assert "multicast: None why: rank 0: ranks share a GPU (devices [0, 0])" in out, out
    assert not [c for c in calls if c.entry.startswith("cuMulticast")]
    # Two heaps per rank (the test's own, then the engine path's), each imported by the other rank.
    assert len([c for c in calls if c.entry == "cuMemImportFromShareableHandle"]) == 2 * WORLD
