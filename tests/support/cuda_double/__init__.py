"""A test double of the CUDA driver: ``libcuda.so.1`` built from the C files of this folder.

Tests and benchmarks load it in place of the driver (``gpucomm.toolchain.native``'s launcher takes its path;
``ctypes.CDLL(build())`` reaches its test-only entry points). It has no device: it records what a
caller hands the driver, one line per call, appended to the file named by
``DRIVER_DOUBLE_LOG`` when the library loads, or to the one :func:`log_to` names from then on
(:func:`records` reads it back). A launch's line says
the kernel's name, grid, block, shared memory, stream, whether a graph captured it, and its
parameter bytes. Every line ends with ``ctx``: the device of the context current in the calling
thread at that call (-1: none). The double models a node (``devices.c``, read from the environment
when it loads): 8 GPUs by default (``DRIVER_DOUBLE_GPUS``), each an H100's 132 SMs and sm_90
(``DRIVER_DOUBLE_SMS``, ``DRIVER_DOUBLE_CC``), its UUID, peer access and native peer atomics per pair
(``DRIVER_DOUBLE_LINKS``: ``nvswitch``, ``pcie`` without native atomics, ``none``), the devices this
process sees (``CUDA_VISIBLE_DEVICES``), and each visible device's primary context; a function
launches only in the context its module was loaded in (tests/workspace/test_multi_device.py,
tests/workspace/test_node_layouts.py).

A launch runs nothing, except the kernels of a host image (``double.h``, ``host_run.c``): a module
image that names a library of kernels built for the host (gpucomm's CUDA C++ kernels under
``GPUCOMM_CUDA_EMULATE``). Those run at their launch, with the parameters the caller packed, and a
captured one at each replay of its graph (tests/ops/test_double_host_run.py).

Adding entry points: put them in a ``.c`` file here (every ``*.c`` is compiled into the one
library), include ``double.h``, mark each ``DOUBLE_API`` and record through ``double_log``. Types
and result codes come from ``double.h`` (extend it; it follows cuda.h's sizes and values without
needing the toolkit). ``cuGetProcAddress``/``cuGetProcAddress_v2`` find every exported function by
name (trying ``name_v3``, ``name_v2``, then ``name``), so cuda.bindings reaches new ones unchanged;
export a versioned name (``cuFoo_v2``) where cuda.h maps ``cuFoo`` to it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import subprocess
import tempfile

__all__ = ["build", "records", "launches", "log_to", "Record", "LOG_VARIABLE"]

LOG_VARIABLE = "DRIVER_DOUBLE_LOG"
_HERE = pathlib.Path(__file__).resolve().parent
_COMPILE_TIMEOUT_S = 60.0


def build(cache: str | os.PathLike | None = None) -> str:
    """The path of the double's ``libcuda.so.1``, compiled now or found in ``cache`` (default: a
    folder under the system's temporary directory), keyed by the sources' text."""
    sources = sorted(_HERE.glob("*.c"))
    digest = hashlib.sha256()
    for path in [*sources, _HERE / "double.h"]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    folder = pathlib.Path(cache or os.path.join(tempfile.gettempdir(), "gpucomm-cuda-double")) / digest.hexdigest()[:16]
    target = folder / "libcuda.so.1"
    if target.exists():
        return str(target)
    folder.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=folder, prefix=".libcuda-", suffix=".so")
    os.close(fd)
    try:
        cmd = [
            "cc",
            "-O2",
            "-shared",
            "-fPIC",
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fvisibility=hidden",
            *map(str, sources),
            "-o",
            scratch,
            "-ldl",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"cuda_double.build: {' '.join(cmd)} failed:\n{done.stderr}")
        os.replace(scratch, target)  # ranks building at once never load half a library
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return str(target)


class Record(dict):
    """One recorded call: its entry point (``entry``) and its ``key=value`` fields, as strings."""

    @property
    def entry(self) -> str:
        return self["entry"]


def records(log: str | os.PathLike, entry: str | None = None) -> list[Record]:
    """The calls recorded in ``log``, in order (only those of ``entry`` if given)."""
    found = []
    for line in pathlib.Path(log).read_text().splitlines():
        name, *fields = line.split(" ")
        if entry is not None and name != entry:
            continue
        record = Record(entry=name)
        for field in fields:
            key, _, value = field.partition("=")
            record[key] = value
        found.append(record)
    return found


def launches(library: str) -> int:
    """Launches the double loaded from ``library`` recorded in this process so far."""
    lib = ctypes.CDLL(library)
    lib.doubleLaunches.restype = ctypes.c_ulonglong
    return lib.doubleLaunches()


def log_to(library: str, log: str | os.PathLike | None) -> None:
    """Make the double loaded from ``library`` in this process record into ``log`` (None: nowhere)."""
    lib = ctypes.CDLL(library)
    lib.doubleLogTo.argtypes = [ctypes.c_char_p]
    if lib.doubleLogTo(None if log is None else os.fsencode(log)) != 0:
        raise OSError(f"cuda_double.log_to: cannot open {log}")
