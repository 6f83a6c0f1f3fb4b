"""Ranks that open gpucomm's GPU heap (gpucomm/transport/vmm.py, multicast.py) on the driver double, each a fresh
process whose ``libcuda.so.1`` is the double (tests/support/cuda_double, with its vmm.c), reached
through cuda.bindings as on a GPU. Shared by tests/transport/test_vmm.py and
tests/workspace/test_multi_device.py.

``run_heap_ranks(tmp_path, order)`` runs the script ``_RANK`` on every rank; ``order`` picks what
it does after the heap opens: ``kept`` (the multicast set-up in the driver's order), ``early`` (a
bind before every device is added), ``engine`` and ``engine_refused`` (gpucomm.transport.heap_open's
path), ``other_context`` and ``device_one`` (another GPU's context current), ``release_fails``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import cuda_double
from spawn import free_port

__all__ = ["WORLD", "HEAP", "run_heap_ranks"]

WORLD = 2
HEAP = 3 << 20  # rounded up to the double's 2 MiB granularity: 4 MiB per rank

_RANK = """
import ctypes, sys, torch
from gpucomm.transport.fdpass import FdExchange
from gpucomm.transport import multicast, vmm

rank, world, port, nbytes, order = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
timeout = __import__("datetime").timedelta(seconds=30)
store = torch.distributed.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timeout)
from gpucomm.transport import heap_open
if order == "engine_refused":  # the engine's path with a refusal the test's env plants
    started = __import__("time").monotonic()
    try:
        heap_open.open_vmm_parts(store, "refused/", rank, world, 0, nbytes, 30)
        print("opened")
    except vmm.VmmHeapRefused as exc:
        print(f"refused after {__import__('time').monotonic() - started:.1f} s: {exc}")
    sys.exit(0)
assert vmm.vmm_unavailable(0) == "", vmm.vmm_unavailable(0)
me = vmm.gpu_identity(0)
assert len(me) == 32, me
assert multicast.multicast_unavailable(0, [me, me[::-1]]) == ""
assert "ranks share a GPU" in multicast.multicast_unavailable(0, [me, me])
exchange = FdExchange(store, "test/", rank, world, timeout=30)
if order == "other_context":  # this thread holds another GPU's context when the heap opens
    from cuda.bindings import driver
    driver.cuInit(0)
    _, other = driver.cuDevicePrimaryCtxRetain(1)
    driver.cuCtxSetCurrent(other)
if order == "device_one":  # this thread holds GPU 0's context; the heap and its multicast object are GPU 1's
    from cuda.bindings import driver
    driver.cuInit(0)
    driver.cuCtxSetCurrent(driver.cuDevicePrimaryCtxRetain(0)[1])
    heap = vmm.open_vmm_heap(exchange, rank, world, 1, nbytes)
    agreed = lambda stage, mine: heap_open.agree(store, f"test/{stage}/", rank, world, 30, mine)
    mc, why = multicast.bind_multicast(exchange, agreed, rank, world, heap)
    print("multicast:", "made" if mc else None, "why:", why)
    agreed("used", "")
    if mc:
        mc.release()
    heap.release()
    exchange.close()
    print("context after: device", int(driver.cuCtxGetDevice()[1]))
    sys.exit(0)
heap = vmm.open_vmm_heap(exchange, rank, world, 0, nbytes)
agreed = lambda stage, mine: heap_open.agree(store, f"test/{stage}/", rank, world, 30, mine)
barrier = lambda stage: agreed(stage, "")
# The heap is shared: write this rank's number into its heap, read every rank's through its mapping.
ctypes.c_int64.from_address(heap.bases[rank] + 64).value = 1000 + rank
barrier("written")
seen = [ctypes.c_int64.from_address(base + 64).value for base in heap.bases]
assert seen == [1000 + p for p in range(world)], seen
assert ctypes.c_int64.from_address(heap.bases[rank]).value == 0  # zeroed at creation
if order == "release_fails":  # every unmap refused: the rest of the release still happens
    try:
        heap.release()
    except Exception as exc:
        print("release raised:", exc)
    exchange.close()
    sys.exit(0)
if order == "other_context":
    heap.release()
    exchange.close()
    print("context after open and release: device", int(driver.cuCtxGetDevice()[1]))
    sys.exit(0)
if order == "engine":  # the engine's path (gpucomm.transport.heap_open), GPUs as the test's env says
    heap.release()
    kind = lambda mine: heap_open.agree(store, "engine/kind/", rank, world, 30, mine)
    print("kind:", heap_open.heap_kind(torch.device("cuda", 0), kind))
    mapping, mc, release, why = heap_open.open_vmm_parts(store, "engine/", rank, world, 0, nbytes, 30)
    print("multicast:", "made" if mc else None, "why:", why, "size:", mapping.size)
    if mc:  # the heap's bytes through the multicast mapping (the double's object is memory of its own)
        ctypes.c_int64.from_address(mc.address + 8 * rank).value = 7
    barrier("engine_used")
    release()
    exchange.close()
    sys.exit(0)
if order == "kept":
    mc, why = multicast.bind_multicast(exchange, agreed, rank, world, heap)
    assert why == "", why
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
        fd = exchange.receive([0], 2)[0]
        _, handle = driver.cuMemImportFromShareableHandle(fd, posix_fd)
        err, = driver.cuMulticastBindMem(handle, 0, heap.own_handle, 0, heap.size, 0)
        print("bind before add:", int(err))
        barrier("done")
    driver.cuMemRelease(handle)
heap.release()
exchange.close()
"""


def run_heap_ranks(tmp_path, order: str, rank_env: dict[int, dict[str, str]] | None = None) -> tuple[list, list]:
    """Run WORLD rank processes of the script above, each told ``order``, on the driver double (its
    log under ``tmp_path``); ``rank_env`` adds variables to some ranks. Returns each rank's
    (exit code, stdout, stderr) and the double's records of every rank's driver calls, in order."""
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
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), str(WORLD), str(port), str(HEAP), order],
            env={**env, **(rank_env or {}).get(r, {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
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
