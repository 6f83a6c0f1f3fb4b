"""Release stores and acquire loads of 64-bit words in host memory.

Python has no memory-ordered loads and stores. The C11 atomics give a flag handoff between
processes over shared memory the same release/acquire guarantee as the GPU kernels give: through
``kernels/host/atomics.c`` (built on first use by :mod:`gpucomm.toolchain.native`, about 40 ns a call from
Python), or where it cannot be built through libatomic's ``__atomic_store_8`` /
``__atomic_load_8`` and ctypes (0.4-0.6 us a call, measured on the 2-core CI VM).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

from gpucomm.errors import UnsupportedError
from gpucomm.toolchain import native

__all__ = ["store_release", "load_acquire", "raw_store_release", "raw_load_acquire"]

# The memory orders of the GCC __atomic builtins (gcc/libatomic ABI).
_ATOMIC_ACQUIRE = 2
_ATOMIC_RELEASE = 3


@functools.cache
def _libatomic() -> ctypes.CDLL:
    """Load libatomic once, on first use (no work at import time)."""
    name = ctypes.util.find_library("atomic")
    if name is None:
        raise UnsupportedError(
            "gpucomm: host flags need libatomic (libatomic.so.1), which was not found; install it "
            "(e.g. `apt-get install libatomic1`) or use GPU kernels"
        )
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise UnsupportedError(f"gpucomm: could not load {name} for host flags: {exc}") from exc
    lib.__atomic_store_8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.__atomic_store_8.restype = None
    lib.__atomic_load_8.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.__atomic_load_8.restype = ctypes.c_int64
    return lib


def _check(fn: str, addr: int) -> None:
    if addr <= 0 or addr % 8:
        raise ValueError(f"{fn}: addr must be a non-null multiple of 8, got {addr:#x}")


def store_release(addr: int, value: int) -> None:
    """Store the int64 ``value`` at ``addr`` with release ordering."""
    _check("store_release", addr)
    raw_store_release()(addr, value)


def load_acquire(addr: int) -> int:
    """Load the int64 at ``addr`` with acquire ordering."""
    _check("load_acquire", addr)
    return raw_load_acquire()(addr)


@functools.cache
def raw_store_release() -> Callable[[int, int], None]:
    """``store(addr, value)`` with release ordering, for loops that checked their addresses once."""
    module = native.load("atomics")
    if module is not None:
        return module.store_release
    store = _libatomic().__atomic_store_8
    return lambda addr, value: store(addr, value, _ATOMIC_RELEASE)


@functools.cache
def raw_load_acquire() -> Callable[[int], int]:
    """``load(addr)`` with acquire ordering, for polling loops that checked their addresses once."""
    module = native.load("atomics")
    if module is not None:
        return module.load_acquire
    load = _libatomic().__atomic_load_8
    return lambda addr: load(addr, _ATOMIC_ACQUIRE)
