"""The CUDA toolkit's tools for tests without a GPU (nvcc, cuobjdump), and the shipped kernels
compiled by nvcc exactly as the run-time loader has NVRTC compile them, once per test session.

nvcc and cuobjdump are required (CI has them): a missing tool fails the test, unless
GPUCOMM_ALLOW_NO_NVCC=1 says this machine is known to lack them, in which case it skips.
cuobjdump is looked for on PATH, in $CUDA_HOME/bin, then in the copy Triton ships.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

__all__ = ["tool", "run", "Fatbins"]


def tool(name: str) -> str:
    """The path of CUDA tool ``name`` (PATH, $CUDA_HOME/bin, Triton's bundled tools); fails the
    test where there is none, or skips it with GPUCOMM_ALLOW_NO_NVCC=1."""
    candidates = [shutil.which(name)]
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        candidates.append(str(Path(cuda_home, "bin", name)))
    candidates.append(str(Path(importlib.util.find_spec("triton").origin).parent / "backends/nvidia/bin" / name))
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    message = f"{name} not found (PATH, $CUDA_HOME/bin, Triton's bundled tools)"
    if os.environ.get("GPUCOMM_ALLOW_NO_NVCC") == "1":
        pytest.skip(message + "; skipped because GPUCOMM_ALLOW_NO_NVCC=1")
    pytest.fail(message + "; set GPUCOMM_ALLOW_NO_NVCC=1 to skip these tests on a machine without CUDA tools")


def run(cmd: list[str], cwd: Path | None = None) -> str:
    """``cmd``'s stdout; raises AssertionError with its output where it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


class Fatbins:
    """``fatbin(file, arch)``: a kernels/cuda file compiled by nvcc with the loader's options into a
    fatbin holding sm_<arch> SASS and compute_<arch> PTX, once per session (the conftest fixture
    ``nvcc_fatbins`` shares one); ``cubin(file, arch)`` is its SASS as the ELF the driver loads."""

    def __init__(self, root: Path) -> None:
        from gpucomm.ops.cuda_ops import HEADER, SOURCES, kernel_source

        self.root = root
        # NVRTC gets common.cuh as an in-memory header; nvcc finds it next to the source.
        for name in (HEADER, *SOURCES):
            (root / name).write_text(kernel_source(name))
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()

    @functools.cache  # noqa: B019 (one instance per session)
    def _built(self, file: str, arch: int) -> Path:
        from gpucomm.ops.cuda_ops import THREADS, compile_options

        fatbin = self.root / f"{Path(file).stem}.sm_{arch}.fatbin"
        # --gpu-architecture=sm_XY makes nvcc embed both sm_XY SASS and compute_XY PTX.
        run(
            [
                tool("nvcc"),
                *compile_options(f"sm_{arch}", {"GPUCOMM_THREADS": THREADS}),
                "-fatbin",
                "-o",
                str(fatbin),
                str(self.root / file),
            ]
        )
        return fatbin

    def fatbin(self, file: str, arch: int) -> Path:
        with self._guard:
            lock = self._locks.setdefault((file, arch), threading.Lock())
        with lock:  # callers on several threads compile each (file, arch) once
            return self._built(file, arch)

    def cubin(self, file: str, arch: int) -> bytes:
        folder = self.root / f"{Path(file).stem}.sm_{arch}.elf"
        with self._guard:
            lock = self._locks.setdefault((file, -arch), threading.Lock())
        with lock:
            if not folder.exists():
                fatbin = self.fatbin(file, arch)
                folder.mkdir()
                run([tool("cuobjdump"), "-xelf", "all", str(fatbin)], cwd=folder)
        (elf,) = folder.glob("*.cubin")
        return elf.read_bytes()
