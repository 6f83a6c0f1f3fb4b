"""The tests' CUDA driver double (tests/support/cuda_double), for benchmarks without a GPU.

Benchmarks that time the host's side of a launch use its library, and the host-only Triton
kernels bound on it.

Benchmark-only and explicit: a rank calls :func:`install_host_only_kernels` before
``init_process_group``; nothing in gpucomm chooses it. The double runs no kernel, so a collective
timed this way does nothing on the data: what is timed is the host's work up to and including the
call into the driver (gpucomm's Python, the bound launch, ``cuLaunchKernel``'s entry).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import pathlib
import sys
import time

__all__ = ["library", "launches", "install_host_only_kernels", "wait_for_peers", "TARGET_ARCH"]

# What the kernels are compiled for: an H100's sm_90, as the lent GPUs are.
TARGET_ARCH = 90
_DOUBLE = pathlib.Path(__file__).resolve().parent.parent / "tests" / "support" / "cuda_double"


def library() -> str:
    """The path of the double's libcuda.so.1, built on first use.

    Needs a checkout: the double's sources live in tests/, which a wheel does not ship.
    """
    if not (_DOUBLE / "__init__.py").exists():
        raise SystemExit(
            f"the CUDA driver double's sources are not at {_DOUBLE}: run this benchmark from a gpucomm checkout"
        )
    spec = importlib.util.spec_from_file_location("cuda_double", _DOUBLE / "__init__.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules.setdefault("cuda_double", module)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.build()


def install_host_only_kernels(double: str) -> None:
    """Install this process's Triton kernels on CPU tensors, bound on the double at ``double``.

    The program kernel is compiled for sm_90 and bound through gpucomm's launcher. TRITON_INTERPRET
    must be unset.
    """
    from triton.backends.compiler import GPUTarget

    from gpucomm.ops import registry
    from gpucomm.ops.triton_ops import HostOnlyTritonKernels

    registry.install("triton", "cpu", HostOnlyTritonKernels(GPUTarget("cuda", TARGET_ARCH, 32), double))


def launches(double: str) -> int:
    """Launches the double at ``double`` recorded in this process so far."""
    lib = ctypes.CDLL(double)
    lib.doubleLaunches.restype = ctypes.c_ulonglong
    return lib.doubleLaunches()


def wait_for_peers(folder: str, step: str, rank: int, world: int, timeout: float = 300.0) -> None:
    """Wait until every rank has reached ``step`` (a file per rank in ``folder``).

    On the double the collectives wait for nobody (no kernel runs), so a rank that finished would
    otherwise tear its workspace down while a peer still opens it.
    """
    pathlib.Path(folder, f"{step}.{rank}").touch()
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(folder, f"{step}.{r}")) for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"wait_for_peers: not every rank of {world} reached {step} within {timeout} s")
        time.sleep(0.01)
