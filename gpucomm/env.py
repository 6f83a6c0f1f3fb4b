"""``python -m gpucomm.env`` / ``gpucomm.collect_env()``: a report of what this host gives gpucomm.

It is made to be pasted into a bug report.

Versions (gpucomm, torch, Triton, CuPy, the CUDA runtime and driver), each transport and whether
this host can use it (and why not), what ``auto`` picks for CPU and CUDA tensors, and the knobs
that are set. It starts no process group and no thread, loads CuPy only where a GPU is (to ask
the CUDA runtime), and takes well under two seconds beyond Python's import of torch
(tests/test_env.py times it).

Example::

    $ python -m gpucomm.env
    gpucomm 0.1.0 environment
    versions
      gpucomm          0.1.0
      torch            2.13.0+cpu (CUDA build: no)
    ...
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.metadata
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from gpucomm.config import Config
from gpucomm.ops.registry import kernels_run_on_cpu, resolved_name
from gpucomm.toolchain.native import cache_dir
from gpucomm.transport.cuda_ipc import cuda_ipc_available
from gpucomm.transport.shm import SHM_DIR
from gpucomm.workspace.layout import cpu_segment_bytes

__all__ = ["EnvReport", "collect_env", "main"]

# The variables a report lists when set: gpucomm's knobs, and the others that change what it does.
_OTHER_VARIABLES = (
    "TRITON_INTERPRET",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_PIPE_DIRECTORY",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "MASTER_ADDR",
)
# CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED in cuda.h (CUDA 12.1 and later).
_CU_MULTICAST_SUPPORTED = 132
# Ranks the shm line counts up to: more than any node runs (the count is a loop of sizes).
_MAX_RANKS_COUNTED = 4096
_COMPILER_TIMEOUT_S = 5.0  # `cc --version` answers in milliseconds; a minute would be a hung compiler


@dataclasses.dataclass
class EnvReport:
    """The report: sections of (name, value) rows; ``str()`` is the pasteable text."""

    sections: list[tuple[str, list[tuple[str, str]]]]
    seconds: float  # how long collecting took

    def __str__(self) -> str:
        width = max(len(name) for _, rows in self.sections for name, _ in rows)
        lines = [f"gpucomm {_version('gpucomm')} environment (collected in {self.seconds:.2f} s)"]
        for title, rows in self.sections:
            lines.append(title)
            for name, value in rows:
                text = value.splitlines() or [""]
                lines.append(f"  {name:<{width}}  {text[0]}")
                lines.extend(f"  {'':<{width}}  {more}" for more in text[1:])
        return "\n".join(lines)

    def get(self, section: str, name: str) -> str:
        """One value: ``report.get("transports", "shm")``; KeyError where the section has no such row."""
        for title, rows in self.sections:
            if title == section:
                for row, value in rows:
                    if row == name:
                        return value
        raise KeyError(f"gpucomm.collect_env: no row {name!r} in section {section!r}")


def collect_env() -> EnvReport:
    """Collect the report (no process group needed; nothing is started)."""
    start = time.perf_counter()
    config, config_error = _config()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cupy_ok, cupy_why = cuda_ipc_available() if gpus else (False, f"no CUDA device ({_no_gpu_why()})")
    sections = [
        ("versions", _versions(gpus)),
        ("GPUs", _gpus(gpus)),
        ("transports", _transports(config, gpus, cupy_ok, cupy_why)),
        ("host code", _host_code()),
        ("auto picks", _auto(config, config_error, gpus, cupy_ok, cupy_why)),
        ("knobs set", _knobs(config, config_error)),
    ]
    return EnvReport(sections, time.perf_counter() - start)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cupy_distributions() -> list[str]:
    return sorted(
        d.metadata["Name"]
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith("cupy")
    )


def _cupy_version() -> str:
    found = _cupy_distributions()
    if not found:
        return "not installed (the cuda_ipc transport needs it: pip install gpucomm[cuda12] or [cuda13])"
    return ", ".join(f"{name} {_version(name)}" for name in found)


def _versions(gpus: int) -> list[tuple[str, str]]:
    cuda_build = torch.version.cuda
    rows = [
        ("gpucomm", _version("gpucomm")),
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("platform", f"{platform.system()} {platform.release()} {platform.machine()}, {os.cpu_count()} CPUs"),
        (
            "torch",
            f"{torch.__version__} (CUDA build: {cuda_build or 'no'}; "
            f"gloo: {'yes' if dist.is_gloo_available() else 'no'})",
        ),
        ("triton", _version("triton")),
        ("cupy", _cupy_version()),
        ("CUDA runtime", _cuda_runtime(gpus)),
        ("CUDA driver", _driver_version()),
    ]
    return rows


def _cuda_runtime(gpus: int) -> str:
    if torch.version.cuda is None:
        return "none (torch is a CPU build)"
    text = f"torch's {torch.version.cuda}"
    if gpus:
        try:
            import cupy

            version = cupy.cuda.runtime.runtimeGetVersion()
            text += f"; CuPy's {version // 1000}.{version % 1000 // 10}"
        except ImportError:
            pass
    return text


def _libcuda() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def _driver_version() -> str:
    lib = _libcuda()
    if lib is None:
        return "no NVIDIA driver (libcuda.so.1 not found)"
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return "libcuda.so.1 found, but cuDriverGetVersion failed"
    return f"{version.value // 1000}.{version.value % 1000 // 10} (the newest CUDA it runs)"


def _no_gpu_why() -> str:
    return "torch is a CPU build" if torch.version.cuda is None else "torch sees no CUDA device"


def _gpus(gpus: int) -> list[tuple[str, str]]:
    if not gpus:
        return [("devices", f"none ({_no_gpu_why()}): CPU tensors only")]
    rows = []
    for i in range(gpus):
        props = torch.cuda.get_device_properties(i)
        rows.append(
            (
                f"cuda:{i}",
                f"{props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
                f"{props.multi_processor_count} SMs",
            )
        )
    if gpus > 1:
        pairs = [
            f"{a}->{b}: {'yes' if torch.cuda.can_device_access_peer(a, b) else 'NO'}"
            for a in range(gpus)
            for b in range(gpus)
            if a != b
        ]
        rows.append(("peer access", ", ".join(pairs)))
    rows.append(("multicast", _multicast(gpus)))
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    rows.append(
        (
            "MPS",
            f"control pipe at {pipe}: ranks sharing a GPU run concurrently"
            if os.path.isdir(pipe)
            else f"not running (no {pipe})",
        )
    )
    return rows


def _multicast(gpus: int) -> str:
    """NVLink SHARP multicast (``cuMulticast*``) per device, from the driver."""
    lib = _libcuda()
    if lib is None or lib.cuInit(0) != 0:
        return "unknown (the driver did not initialise)"
    answers = []
    for i in range(gpus):
        device, value = ctypes.c_int(0), ctypes.c_int(0)
        if (
            lib.cuDeviceGet(ctypes.byref(device), i) != 0
            or lib.cuDeviceGetAttribute(ctypes.byref(value), _CU_MULTICAST_SUPPORTED, device) != 0
        ):
            answers.append(f"cuda:{i} unknown (driver older than CUDA 12.1)")
        else:
            answers.append(f"cuda:{i} {'yes' if value.value else 'no'}")
    return ", ".join(answers)


def _shm(config: Config | None) -> str:
    if not os.path.isdir(SHM_DIR):
        return f"NO: {SHM_DIR} does not exist"
    if not os.access(SHM_DIR, os.W_OK):
        return f"NO: {SHM_DIR} is not writable"
    fs = os.statvfs(SHM_DIR)
    size, free = fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize
    config = config if config is not None else Config()
    kernels = resolved_name(config.kernels if kernels_run_on_cpu(config.kernels) else "auto", "cpu")
    workspace = config.workspace_bytes_for("cpu")
    heap = config.heap_bytes_for("cpu")

    def per_rank(ranks: int) -> int:  # the engine's own arithmetic (gpucomm.workspace.layout)
        return cpu_segment_bytes(workspace, kernels, config.channels, ranks)

    fits = _ranks_that_fit(free, per_rank)
    verdict = "yes" if fits >= 2 else "NO"
    line = (
        f"{verdict}: {SHM_DIR} {size / 2**20:.0f} MiB, {free / 2**20:.0f} MiB free: "
        f"room for {fits} ranks' workspaces of {per_rank(2) / 2**20:.1f} MiB"
    )
    if heap:
        with_heap = _ranks_that_fit(free, lambda ranks: per_rank(ranks) + heap)
        line += f", {with_heap} with a symmetric heap of {heap / 2**20:.1f} MiB each (gpucomm.empty opens it)"
    return line


def _ranks_that_fit(free: int, per_rank: Callable[[int], int]) -> int:
    """The most ranks whose segments (``per_rank(ranks)`` bytes each) fit in ``free`` bytes."""
    ranks = 0
    while ranks < _MAX_RANKS_COUNTED and (ranks + 1) * per_rank(ranks + 1) <= free:
        ranks += 1
    return ranks


def _transports(config: Config | None, gpus: int, cupy_ok: bool, cupy_why: str) -> list[tuple[str, str]]:
    gloo = (
        "yes: every collective, any device, across hosts" if dist.is_gloo_available() else "NO: this torch has no gloo"
    )
    if cupy_ok:
        ipc = f"yes: {gpus} GPU(s), CuPy opens peers' cudaIpc handles"
        if gpus > 1 and not all(
            torch.cuda.can_device_access_peer(a, b) for a in range(gpus) for b in range(gpus) if a != b
        ):
            ipc += "; some GPU pairs have no peer access (see GPUs): ranks on them fail at init"
    else:
        ipc = f"NO: {cupy_why}" + ("" if gpus or _cupy_distributions() else "; and CuPy is not installed")
    return [("cuda_ipc", ipc), ("shm", _shm(config)), ("gloo", gloo)]


def _host_code() -> list[tuple[str, str]]:
    """The host C code's compiler (gpucomm.toolchain.native builds kernels/host with it), Triton's mode."""
    if os.environ.get("GPUCOMM_NATIVE", "1") == "0":
        compiler = "not used (GPUCOMM_NATIVE=0: the Python twin of the host C code)"
    else:
        configured = shlex.split(sysconfig.get_config_var("CC") or "")[:1]
        command = configured[0] if configured and shutil.which(configured[0]) else "cc"
        path = shutil.which(command)
        if path is None:
            compiler = f"NO: no {command} on PATH: the host C code runs as its Python twin (slower flight record)"
        else:
            try:
                first = subprocess.run(
                    [path, "--version"], capture_output=True, text=True, timeout=_COMPILER_TIMEOUT_S
                ).stdout.splitlines()
                compiler = f"yes: {path} ({first[0] if first else 'no version'}); built code in {cache_dir()}"
            except (OSError, subprocess.TimeoutExpired) as err:
                compiler = f"NO: {path} --version failed ({err})"
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    triton = (
        "interpreter (TRITON_INTERPRET=1): Triton kernels run on CPU tensors"
        if interpreting
        else "compiled for GPUs (set TRITON_INTERPRET=1 before triton is imported to run them on CPU tensors)"
    )
    nvcc = shutil.which("nvcc")
    return [
        ("C compiler", compiler),
        ("Triton", triton),
        ("nvcc", nvcc or "not on PATH (not needed at run time: CUDA C++ kernels compile with NVRTC)"),
    ]


def _config() -> tuple[Config | None, str]:
    try:
        return Config.from_env(), ""
    except (TypeError, ValueError) as err:
        return None, str(err)


def _auto(config: Config | None, error: str, gpus: int, cupy_ok: bool, cupy_why: str) -> list[tuple[str, str]]:
    """What a communicator made now would serve each device's tensors with.

    The rule of Communicator._workspace_plan (tests/test_env.py checks that the two agree).
    """
    if config is None:
        return [("CPU tensors", f"init would fail: {error}"), ("CUDA tensors", f"init would fail: {error}")]
    cpu_kernels = resolved_name(config.kernels if kernels_run_on_cpu(config.kernels) else "auto", "cpu")
    shm = f"workspace transport=shm kernels={cpu_kernels}"
    if not gpus:
        ipc = "none: no CUDA device" + (
            " (GPUCOMM_TRANSPORT=cuda_ipc fails at init)" if config.transport == "cuda_ipc" else ""
        )
    elif not cupy_ok:
        ipc = f"init fails: {cupy_why}"
    else:
        ipc = f"workspace transport=cuda_ipc kernels={resolved_name(config.kernels, 'cuda')}"
    cpu, cuda = {
        "gloo": ("gloo (GPUCOMM_TRANSPORT=gloo)", "gloo (GPUCOMM_TRANSPORT=gloo)"),
        "shm": (shm, "gloo (GPUCOMM_TRANSPORT=shm serves CPU tensors only)"),
        "cuda_ipc": ("gloo (GPUCOMM_TRANSPORT=cuda_ipc serves CUDA tensors only)", ipc),
    }.get(config.transport, (f"{shm} when every rank is on this host, else gloo", ipc))
    return [
        ("CPU tensors", cpu),
        ("CUDA tensors", cuda),
        ("algorithm", f"{config.algo} (GPUCOMM_ALGO)"),
        ("timeout", f"{config.timeout:g} s"),
    ]


def _knobs(config: Config | None, error: str) -> list[tuple[str, str]]:
    names = sorted(k for k in os.environ if k.startswith("GPUCOMM_")) + [k for k in _OTHER_VARIABLES if k in os.environ]
    rows = [(name, os.environ[name]) for name in names]
    if error:
        rows.append(("(error)", error))
    return rows or [("(none)", "every GPUCOMM_* knob at its default")]


def main(argv: list[str] | None = None) -> int:
    if argv:
        print("usage: python -m gpucomm.env   (prints gpucomm's environment report; no arguments)", file=sys.stderr)
        return 2
    print(collect_env())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
