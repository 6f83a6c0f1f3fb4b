"""Release stores and acquire loads of 64-bit words in host memory, through libatomic.

Python has no memory-ordered loads and stores; libatomic's ``__atomic_store_8`` /
``__atomic_load_8`` are the C11 atomics themselves, so a flag handoff between processes over
shared memory gets the same release/acquire guarantee as the GPU kernels give.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from gpucomm.errors import UnsupportedError

__all__ = ["store_release", "load_acquire", "raw_store_release", "raw_load_acquire", "ACQUIRE", "RELEASE"]

# The memory orders of the GCC __atomic builtins (gcc/libatomic ABI).
_ATOMIC_ACQUIRE = ACQUIRE = 2
_ATOMIC_RELEASE = RELEASE = 3


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
    _libatomic().__atomic_store_8(addr, value, _ATOMIC_RELEASE)


def load_acquire(addr: int) -> int:
    """Load the int64 at ``addr`` with acquire ordering."""
    _check("load_acquire", addr)
    return _libatomic().__atomic_load_8(addr, _ATOMIC_ACQUIRE)


def raw_store_release() -> ctypes._CFuncPtr:
    """libatomic's ``__atomic_store_8(addr, value, order)``, for loops that checked their
    addresses once: call it with ``RELEASE``."""
    return _libatomic().__atomic_store_8


def raw_load_acquire() -> ctypes._CFuncPtr:
    """libatomic's ``__atomic_load_8(addr, order)``, for polling loops that checked their
    addresses once: call it with ``ACQUIRE``."""
    return _libatomic().__atomic_load_8

