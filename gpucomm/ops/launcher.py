"""Kernel launches bound once: gpucomm's host launcher (``kernels/host/launch.c``) from Python.

:func:`driver` opens the CUDA driver through the launcher (``libcuda.so.1``, or a path: the tests'
driver double), :func:`bind` packs a kernel's parameters once, each at its offset in the kernel's
parameter buffer, and returns the launcher's ``Bound``: ``bound.launch(stream)`` is one call into
the driver's ``cuLaunchKernel``, building no Python object. Where the launcher cannot be built
(no C compiler, ``GPUCOMM_NATIVE=0``), :func:`driver` returns None and the kernels keep their
own launcher (Triton's compiled kernel's, CuPy's Function).

A parameter is packed at the next offset aligned to its size (a kernel's ``.entry`` lays out its
``.param`` space so: every parameter gpucomm's kernels take is a 4- or 8-byte integer or pointer).
Where the driver can read the kernel's own layout (``cuFuncGetParamInfo``, CUDA 12.4), :func:`bind`
checks the packing against it once, so a wrong parameter list fails at the bind, not in a kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

from gpucomm.errors import GpucommError
from gpucomm.toolchain import native

__all__ = ["Param", "driver", "bind", "layout", "LaunchBindError", "MAX_DYNAMIC_SHARED"]

# cuFuncSetAttribute's CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: a launch with more than
# 48 KiB of dynamic shared memory must raise the function's limit first.
MAX_DYNAMIC_SHARED = 8
_DEFAULT_SHARED_LIMIT = 48 * 1024


class Param(NamedTuple):
    """One kernel parameter: its name (for messages), its size in bytes, the value it carries."""

    name: str
    size: int
    value: int


class LaunchBindError(GpucommError):
    """A kernel's parameters as packed disagree with the kernel's own (a bug in gpucomm)."""


@functools.cache
def driver(path: str | None = None) -> Any | None:
    """The CUDA driver at ``path`` (default ``libcuda.so.1``) through gpucomm's launcher, opened once
    per process; None where the launcher cannot be built here. Raises OSError where the driver
    cannot be opened."""
    module = native.load("launch")
    if module is None:
        return None
    return module.Driver(path)


def layout(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[(offset, size)] of parameters of ``sizes`` bytes, each at the next offset aligned to its size."""
    found, end = [], 0
    for size in sizes:
        offset = -(-end // size) * size
        found.append((offset, size))
        end = offset + size
    return found


def bind(
    drv: Any,
    function: int,
    params: Sequence[Param],
    *,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared: int = 0,
    stream: int = 0,
) -> Any:
    """The launch of ``function`` with ``params`` (the kernel's whole parameter list, in order) over
    ``grid`` × ``block`` with ``shared`` bytes of dynamic shared memory: a ``Bound`` whose
    ``launch(stream)`` launches it; calling it with no argument launches on ``stream``."""
    packed = layout([p.size for p in params])
    kernel = drv.param_info(function)
    if kernel is not None and [tuple(k) for k in kernel] != packed:
        raise LaunchBindError(
            f"gpucomm launcher: the kernel's parameters are {kernel} (offset, size), packed as {packed} for "
            f"{[p.name for p in params]}"
        )
    if shared > _DEFAULT_SHARED_LIMIT:
        drv.set_attribute(function, MAX_DYNAMIC_SHARED, shared)
    return drv.bind(function, grid, block, shared, packed, [p.value for p in params], stream=stream)
