"""Symmetric tensors (gpucomm.empty): tensors in the node's symmetric heap, read in place.

Every collective on symmetric tensors must give bitwise the bytes it gives on ordinary tensors with
the same values (the in-place two-shot all_reduce included: same fold, same order), on every rank,
with the torch kernels at 2 and 4 ranks and with the real Triton program kernel under the
interpreter at 2 ranks. The in-place programs must really be in place: the two-shot all_reduce's has
no workspace slot among its operands and three syncs, and broadcast, reduce, all_gather_into_tensor
and reduce_scatter_tensor run theirs above one half. Ranks that disagree (different allocations, a
symmetric tensor against an ordinary one) raise CommMismatchError; blocks are reused once their
tensors are gone; a symmetric tensor stays readable after its group is destroyed. The heap opens at
the first empty(), not before: a group that never asks for it maps and agrees nothing about it.
"""

from __future__ import annotations

import random

import pytest
from spawn import run_ranks
from symmetric_ranks import every_collective_symmetric_and_ordinary


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_collective_on_symmetric_tensors_torch_kernels(world_size: int) -> None:
    import torch

    seed = random.randrange(1 << 30)
    # 10000 elements: more than one 18 KiB half of the 48K workspace in every dtype here, so the
    # direct collectives run in place too.
    sizes = (0, 1, 7, 4099, 10000)
    dtypes = (torch.float32, torch.bfloat16, torch.int64)
    results = run_ranks(every_collective_symmetric_and_ordinary, world_size, seed, "torch", sizes, dtypes, timeout=600)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:20])


def test_symmetric_all_reduce_triton_kernels() -> None:
    """The real program kernel under the interpreter: every collective on symmetric tensors, the
    in-place two-shot (forced) at 7 elements, every in-place program at 10000."""
    import torch

    seed = random.randrange(1 << 30)
    results = run_ranks(
        every_collective_symmetric_and_ordinary,
        2,
        seed,
        "triton",
        (7, 10000),
        (torch.float32, torch.bfloat16),
        env={"TRITON_INTERPRET": "1"},
        timeout=600,
    )
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:20])


def _misuse(rank: int, world_size: int) -> list[str]:
    import torch

    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels="torch", workspace_bytes="48K", heap_bytes="256K", timeout=20)
    comm = gpucomm.get_default_communicator()
    seen = []
    # Blocks come back once their tensors are gone, at the same offsets on every rank.
    heap = comm.heap("cpu")
    a = gpucomm.empty(100, dtype=torch.float32)
    first = heap.offset(a)
    view = a[10:20]
    del a
    b = gpucomm.empty(100, dtype=torch.float32)
    seen.append(f"view kept its block: {heap.offset(b) != first}")
    del view
    c = gpucomm.empty(8, 8, dtype=torch.float64)
    seen.append(f"freed block reused: {heap.offset(c) == first}, shape {tuple(c.shape)}")
    # rank p's copy, read through the heap's table of bases
    c.fill_(rank)
    gpucomm.barrier()
    seen.append(f"peer copy holds {float(heap.peer(c, 1 - rank)[0, 0])}")
    gpucomm.barrier()
    try:
        gpucomm.empty(1 << 20, dtype=torch.float32)
    except gpucomm.UnsupportedError as err:
        seen.append(f"too big: {err}")
    try:
        gpucomm.empty(100 if rank == 0 else 200, dtype=torch.float32)
    except gpucomm.CommMismatchError as err:
        seen.append(f"sizes differ: {err}")
    # A symmetric tensor on one rank, an ordinary one on the other, at a size that runs two-shot
    # (in place on the symmetric one): their calls differ. (One-shot reads any tensor alike.)
    sym = gpucomm.empty(32768, dtype=torch.float32)  # collective: every rank allocates it
    t = sym if rank == 0 else torch.zeros(32768)
    t.fill_(1)
    try:
        gpucomm.all_reduce(t)
    except gpucomm.CommMismatchError as err:
        seen.append(f"symmetric against ordinary: {type(err).__name__}")
    gpucomm.destroy_process_group()
    seen.append(f"readable after destroy: {float(c[0, 0])}")
    gpucomm.init_process_group(transport="shm", kernels="torch", workspace_bytes="48K", heap_bytes=0, timeout=20)
    try:
        gpucomm.empty(4)
    except gpucomm.UnsupportedError as err:
        seen.append(f"no heap: {err}")
    gpucomm.destroy_process_group()
    return seen


def test_allocation_freeing_and_misuse() -> None:
    results = run_ranks(_misuse, 2, timeout=120)
    for rank, seen in enumerate(results):
        text = "\n".join(seen)
        assert "view kept its block: True" in text, text
        assert "freed block reused: True, shape (8, 8)" in text, text
        assert f"peer copy holds {float(1 - rank)}" in text, text
        assert "too big: gpucomm.empty: 4194304 bytes do not fit the symmetric heap (262144 bytes per rank" in text, (
            text
        )
        assert "sizes differ: gpucomm.empty: allocation 4 of the symmetric heap asks for different sizes" in text, text
        assert "symmetric against ordinary: CommMismatchError" in text, text
        assert f"readable after destroy: {float(rank)}" in text, text
        assert (
            "no heap: gpucomm.empty: this group has no symmetric heap for cpu tensors (GPUCOMM_HEAP_BYTES=0)" in text
        ), text


def _mapped_segments() -> dict[str, int]:
    """gpucomm's /dev/shm segments this process maps (name -> bytes), read from /proc/self/maps:
    the names are unlinked once every rank has mapped them, the mappings still name them."""
    sizes: dict[str, int] = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and parts[5].startswith("/dev/shm/gpucomm_"):
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                sizes[parts[5]] = sizes.get(parts[5], 0) + hi - lo
    return sizes


def _lazy_heap(rank: int, world_size: int) -> list[str]:
    import mmap

    import torch

    import gpucomm
    from gpucomm.workspace.layout import cpu_segment_bytes

    heap_bytes = 1 << 20
    gpucomm.init_process_group(
        transport="shm", kernels="torch", workspace_bytes="48K", heap_bytes=heap_bytes, timeout=30
    )
    comm = gpucomm.get_default_communicator()
    sub = comm.new_subgroup(list(range(world_size)))  # never asks for a heap
    t = torch.ones(8)
    comm.all_reduce(t)
    sub.all_reduce(t)
    problems = []

    def heap_keys(group: object) -> list[str]:
        """The store keys of the heap's open (its handshake, gpucomm.workspace.engine.Engine.open_heap)
        and of its first allocation's agreement (gpucomm.transport.heap.StoreAgreement)."""
        prefix = group._engines["cpu"].heap_prefix
        return [f"{prefix}open0/ws/ws/{r}" for r in range(world_size)] + [
            f"{prefix}heap/0/{r}" for r in range(world_size)
        ]

    def keys_set(group: object) -> list[str]:
        return [k for k in heap_keys(group) if comm.store.check([k])]

    before = _mapped_segments()
    page = mmap.PAGESIZE  # a mapping spans whole pages
    workspace = (
        -(-cpu_segment_bytes(48 << 10, "torch", 0, world_size) // page) * page
    )  # what gpucomm.env counts per rank
    mine = [size for name, size in before.items() if name.endswith(f"_r{rank}") and size == workspace]
    if len(mine) != 2:  # the default group's workspace and the subgroup's, of the size env quotes
        problems.append(f"before empty(): expected 2 own workspace segments of {workspace} bytes, mapped {before}")
    if any(size >= heap_bytes for size in before.values()) or keys_set(comm) or keys_set(sub):
        problems.append(f"before empty(): a heap exists: segments {before}, keys {keys_set(comm) + keys_set(sub)}")
    comm.barrier()  # every rank has looked before any opens the heap
    x = comm.empty(16, dtype=torch.float32)  # opens the heap, on every rank
    x.fill_(rank)
    comm.barrier()
    opened = {name: size for name, size in _mapped_segments().items() if name not in before}
    if sorted(opened.values()) != [heap_bytes] * world_size:
        problems.append(f"empty() mapped {opened}, expected one heap segment of {heap_bytes} bytes per rank")
    if keys_set(comm) != heap_keys(comm) or keys_set(sub):
        problems.append(f"after empty(): heap keys {keys_set(comm)} of the group, {keys_set(sub)} of the subgroup")
    peers = [float(comm.heap("cpu").peer(x, p)[0]) for p in range(world_size)]
    if peers != [float(p) for p in range(world_size)]:
        problems.append(f"every rank's copy holds {peers}")
    if sub._engines["cpu"].heap is not None:
        problems.append("the subgroup opened a heap it never asked for")
    comm.barrier()
    sub.close()
    gpucomm.destroy_process_group()
    return problems


def test_the_heap_opens_at_the_first_empty_and_not_before() -> None:
    """A group that never asks for the heap maps no heap segment and agrees nothing about it;
    the first empty() opens it on every rank (its own segment of GPUCOMM_HEAP_BYTES)."""
    assert run_ranks(_lazy_heap, 2, timeout=120) == [[], []]


def test_free_list_is_first_fit_and_merges() -> None:
    from gpucomm.transport.heap import HEAP_ALIGN, FreeList

    blocks = FreeList(8 * HEAP_ALIGN)
    a, b, c = blocks.allocate(1), blocks.allocate(HEAP_ALIGN + 1), blocks.allocate(HEAP_ALIGN)
    assert (a, b, c) == (0, HEAP_ALIGN, 3 * HEAP_ALIGN)
    assert blocks.allocate(5 * HEAP_ALIGN) is None
    blocks.release(b)
    assert blocks.allocate(HEAP_ALIGN) == HEAP_ALIGN  # first fit: the hole b left
    blocks.release(a)
    blocks.release(HEAP_ALIGN)
    blocks.release(c)
    assert blocks.largest_free() == 8 * HEAP_ALIGN  # every neighbour merged back


def test_pool_allocator_is_deterministic_first_fit() -> None:
    """kernels/host/heap_pool.c, as torch's CUDAPluggableAllocator calls it: the same calls give
    the same offsets and the same hash; another sequence another hash; a full region gives NULL."""
    import ctypes

    from gpucomm.toolchain import native

    lib = native.load("heap_pool")
    assert lib is not None
    c = ctypes.CDLL(lib.__file__)
    c.gpucomm_heap_malloc.restype = ctypes.c_void_p
    c.gpucomm_heap_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    c.gpucomm_heap_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    base = 1 << 40  # never touched: the allocator only does arithmetic on it

    def run(sizes_then_frees: list) -> tuple:
        lib.configure(base, 8 << 10)
        got = []
        for step in sizes_then_frees:
            if step > 0:
                p = c.gpucomm_heap_malloc(step, 0, None)
                got.append(None if p is None else p - base)
            else:
                c.gpucomm_heap_free(base + got[-step - 1], 0, 0, None)
        state = lib.state()
        lib.configure(0, 0)
        return got, state

    got, state = run([100, 600, 512, -2, 100, -1, -4, 1000])
    assert got == [0, 512, 1536, 512, 0]  # 600 takes 1024; its hole, then the merged hole at 0
    assert state[1:3] == (2, 512 + 1024)  # the 512 at 1536 and the 1024 at 0
    again, same = run([100, 600, 512, -2, 100, -1, -4, 1000])
    assert (again, same) == (got, state)
    _, other = run([100, 600, 512, -2, 100, -1, -4, 1100])
    assert other[3] != state[3]  # another size: another hash
    full, _ = run([8 << 10, 1])
    assert full == [0, None]


def _pool(rank: int, world_size: int) -> list[str]:

    import torch

    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels="torch", heap_bytes="1M", timeout=20)
    comm = gpucomm.get_default_communicator()
    seen = []
    pool = comm.mem_pool(64 << 10, device="cpu")
    seen.append(f"block at {comm.heap('cpu').offset(pool.block)}")
    pool.check()
    try:
        pool.mem_pool()
    except gpucomm.UnsupportedError as err:
        seen.append(f"no MemPool: {err}")
    try:
        comm.mem_pool(1024, device="cpu")
    except gpucomm.UnsupportedError as err:
        seen.append(f"second: {err}")
    import ctypes

    c = ctypes.CDLL(pool.lib.__file__)
    c.gpucomm_heap_malloc.restype = ctypes.c_void_p
    c.gpucomm_heap_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    segment = c.gpucomm_heap_malloc(1000 if rank == 0 else 2000, 0, None)  # the ranks' sequences differ
    try:
        pool.check()
    except gpucomm.CommMismatchError as err:
        seen.append(f"differ: {err}")
    try:
        pool.close()  # a segment is out, as torch's MemPool keeps one it cached
    except gpucomm.GpucommError as err:
        seen.append(f"close refused: {err}")
    t = gpucomm.empty(64 << 10, dtype=torch.uint8, device="cpu")  # collective: the block freed, it is here
    if t.data_ptr() <= segment < t.data_ptr() + t.numel():
        seen.append("the heap handed out a segment the pool still had")
    del t
    c.gpucomm_heap_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    c.gpucomm_heap_free(segment, 0, 0, None)
    pool.close()
    gpucomm.destroy_process_group()
    return seen


def test_pool_block_is_symmetric_and_check_finds_differences() -> None:
    results = run_ranks(_pool, 2, timeout=120)
    for seen in results:
        text = "\n".join(seen)
        assert "block at 512" in text, text  # the first block after the multimem signal pad
        assert "no MemPool: gpucomm.mem_pool: torch.cuda.MemPool needs CUDA" in text, text
        assert "second: gpucomm.mem_pool: this process has a symmetric pool already" in text, text
        assert "differ: gpucomm.mem_pool: the ranks' pools differ" in text, text
        assert "close refused: gpucomm.mem_pool: close: torch's MemPool still holds 1 segment(s)" in text, text
        assert "handed out" not in text, text


def test_symmetric_benchmark_runs_and_checks_its_results(tmp_path) -> None:
    """bench/symmetric.py end to end at 2 ranks on small sizes: every series, checked, in JSON."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "symmetric.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpucomm._bench.symmetric",
            "--nproc",
            "2",
            "--max-bytes",
            "2048",
            "--rounds",
            "1",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "results: all correct" in done.stdout
    data = json.loads(out.read_text())
    assert [r["bytes"] for r in data["rows"]] == [8, 32, 128, 512, 2048]
    assert all(r[s] > 0 for r in data["rows"] for s in ("ordinary", "symmetric", "ordinary_2shot", "symmetric_2shot"))
    assert data["wrong"] == []
