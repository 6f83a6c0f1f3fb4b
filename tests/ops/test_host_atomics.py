"""The host flag atomics (gpucomm.ops.host_atomics): C's (kernels/host/atomics.c) and
libatomic's through ctypes store and load the same int64 words, across processes too."""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing

import pytest

from gpucomm.ops import host_atomics
from gpucomm.toolchain import native


def _ctypes_pair():
    lib = host_atomics._libatomic()
    return (lambda addr, value: lib.__atomic_store_8(addr, value, 3)), (lambda addr: lib.__atomic_load_8(addr, 2))


def _c_pair():
    module = native.load("atomics")
    if module is None:
        pytest.skip("no C compiler or Python headers here: libatomic serves")
    return module.store_release, module.load_acquire


PAIRS = {"c": _c_pair, "ctypes": _ctypes_pair}


@pytest.mark.parametrize("impl", sorted(PAIRS))
def test_store_then_load_round_trips_every_int64(impl):
    store, load = PAIRS[impl]()
    page = mmap.mmap(-1, 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    for value in (0, 1, -1, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0):
        store(addr + 8, value)
        assert load(addr + 8) == value
        assert int.from_bytes(page[8:16], "little", signed=True) == value
        assert page[0:8] == bytes(8) and page[16:24] == bytes(8)  # one word written, no more


def _peer(buffer, rounds: int, impl: str) -> None:  # noqa: ANN001
    store, load = PAIRS[impl]()
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    for i in range(1, rounds + 1):
        while load(addr) != i:  # the parent's turn
            pass
        store(addr + 8, i)


@pytest.mark.parametrize("impl", sorted(PAIRS))
def test_flags_hand_off_between_processes(impl):
    store, load = PAIRS[impl]()
    shared = multiprocessing.RawArray(ctypes.c_int64, 2)
    addr = ctypes.addressof(shared)
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_peer, args=(shared, 2000, impl))
    child.start()
    try:
        for i in range(1, 2001):
            store(addr, i)
            while load(addr + 8) != i:
                assert child.is_alive() or load(addr + 8) == i, f"peer gone at round {i}"
    finally:
        child.join(10)
    assert child.exitcode == 0


def test_raw_functions_are_c_where_it_builds():
    if native.load("atomics") is None:
        pytest.skip("no C compiler or Python headers here")
    assert host_atomics.raw_load_acquire() is native.load("atomics").load_acquire
