"""A shared-memory mapping that is given back when its workspace closes, whoever still views it.

Python's ``mmap.mmap(fd, ...)`` keeps a duplicate of the file's descriptor for as long as the
object lives, and its ``close()`` refuses while a view exports its buffer. An unlinked /dev/shm
segment mapped that way keeps its pages until the last view of it is freed, and gpucomm's own
views (the executor's bound steps, kept launches) sit in reference cycles: the memory went back
only when Python's cyclic garbage collector happened to run, and the next job's open could find
/dev/shm full.

A :class:`Mapping` maps the file over an anonymous mapping that Python's mmap owns (so that no
descriptor is kept: the pages are held by the mapping alone) and hands out one tensor over it.
:meth:`Mapping.release` unmaps it, or, where a view still holds it:

- ``evict=True`` (a workspace: only gpucomm's own views): the file's pages are replaced by private
  zero pages at the same addresses (``MAP_FIXED``). The segment's memory goes back now; a view
  left behind reads zeros and writes to memory of its own instead of faulting; the addresses go
  with the last view.
- ``evict=False`` (the symmetric heap: the caller's tensors): the mapping stays, whole, until
  the last view is freed, never while one can still be read.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

__all__ = ["Mapping"]

# Linux's MAP_FIXED (0x10 on x86, Arm, POWER and RISC-V; Python's mmap module does not name it).
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_PROT = mmap.PROT_READ | mmap.PROT_WRITE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]


def _map_fixed(addr: int, size: int, flags: int, fd: int) -> None:
    """Map ``fd`` (or anonymous memory, ``fd`` -1) over ``size`` bytes at ``addr``, in place."""
    got = _libc.mmap(addr, size, _PROT, flags | _MAP_FIXED, fd, 0)
    if got != addr:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap at {addr:#x} of {size} bytes failed: {os.strerror(err)}")


class Mapping:
    """``size`` bytes of the file ``fd``, mapped shared and writable (module docstring).

    The descriptor may be closed as soon as this returns. ``tensor`` is a uint8 view of the
    bytes; it holds an export of the mapping, so that nothing unmaps addresses it can still read.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._mm: mmap.mmap | None = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE, prot=_PROT)
        self.tensor = torch.frombuffer(memoryview(self._mm), dtype=torch.uint8)
        self.addr = self.tensor.data_ptr()
        try:
            _map_fixed(self.addr, size, mmap.MAP_SHARED, fd)
        except OSError:
            self.tensor = None  # type: ignore[assignment]
            self._mm.close()
            raise

    def release(self, evict: bool) -> None:
        """Unmap now where nothing views the bytes; else as the module docstring says. Idempotent."""
        mm, self._mm = self._mm, None
        self.tensor = None  # type: ignore[assignment]
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:  # a view is alive: the address range goes with the last one
            if evict:
                _map_fixed(self.addr, self.size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1)
