"""Knobs: every ``GPUCOMM_*`` environment variable, each also a keyword of ``init_process_group``.

The environment is read once, when a communicator is created; a keyword overrides the variable
of the same name. Values are checked here; whether the host can do what a knob asks is checked
by :func:`gpucomm.comm.communicator.resolve` when the communicator is built.
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

__all__ = [
    "Config",
    "DEFAULT_HEAP_BYTES",
    "TRANSPORTS",
    "KERNELS",
    "ALGOS",
    "CHECKS",
    "ASYNC_ERROR_HANDLING",
    "DEFAULT_TIMEOUT_S",
    "CudaEmulation",
    "cuda_emulation",
    "MAX_TIMEOUT_S",
    "check_timeout",
]

TRANSPORTS = ("auto", "cuda_ipc", "shm", "gloo")
KERNELS = ("auto", "triton", "cuda", "torch")
ALGOS = (
    "auto", "oneshot", "twoshot", "ring", "tree", "direct", "spread", "multimem", "oneshot_lang", "oneshot_small",
)  # fmt: skip
CHECKS = ("fingerprint", "full", "off")
ASYNC_ERROR_HANDLING = ("raise", "abort")

DEFAULT_TIMEOUT_S = 300.0
# The longest timeout gpucomm takes: the longest wait Python's threading can make
# (threading.TIMEOUT_MAX, 2**63 ns: about 292 years on Linux). Beyond it Event.wait, and
# torch's timedelta conversions, raise an OverflowError in the middle of a call.
MAX_TIMEOUT_S = threading.TIMEOUT_MAX
# Data bytes per rank where GPUCOMM_WORKSPACE_BYTES leaves it to gpucomm: a quarter for the
# send/recv mailboxes, then two halves that collectives alternate between, a large message
# moving one half-sized piece per round (two SYNCs per piece for two-shot).
# CPU: 8 MiB (3 MiB halves). GPU: 64 MiB (24 MiB halves), from the model of docs/performance.md
# (python -m gpucomm._bench.model, 8 x H100, 3 us per SYNC; docs/results/2026-11-29-model/): the
# SYNCs of a 1 GiB two-shot take 16.8% of its time with 8 MiB, 4.9% with 32 MiB, 2.6% with 64 MiB,
# 1.4% with 128 MiB (one SYNC a piece: the pipelined two-shot, gpucomm.algorithms.allreduce); 64 MiB is
# within 2% of the fastest 1 GiB call (5.24 ms; 32 MiB 5.36 ms, 128 MiB 5.18 ms, 256 MiB 5.16 ms:
# with every copy-in but the first carried by a fold, more memory saves only SYNCs), and 8 ranks
# sharing one 80 GB GPU (the test layout) still take only 0.5 GB.
DEFAULT_WORKSPACE_BYTES = {"cpu": 8 << 20, "cuda": 64 << 20}
# Bytes of the symmetric heap per rank (gpucomm.empty), where GPUCOMM_HEAP_BYTES leaves it to
# gpucomm. The heap opens at the first call that needs it (gpucomm.workspace.engine.Engine.open_heap), so
# a communicator that never asks for one pays nothing; one that does pays all of it at once: its
# pages are reserved when it opens (a shared-memory segment reserves every page at creation, so
# that a small /dev/shm is an error and never a SIGBUS later), and on a GPU the memory is
# allocated outright. CPU: 16 MiB per rank of real memory in /dev/shm, beside the workspace's
# 11 MiB (a container's default 64 MiB holds 2 ranks with their heaps, 5 without); room for the
# CPU tests' symmetric tensors, which stand in for a GPU's. GPU: 1 GiB (1.25% of an H100's
# 80 GB, and room for a 512 MiB gradient bucket with its spare).
DEFAULT_HEAP_BYTES = {"cpu": 16 << 20, "cuda": 1 << 30}
# Smallest workspace that still holds a flag area and two aligned data halves.
MIN_WORKSPACE_BYTES = 4096
# Channels of the program kernel at most (one thread block each).
MAX_CHANNELS = 64


@dataclass(frozen=True)
class Config:
    transport: str = "auto"
    kernels: str = "auto"
    algo: str = "auto"
    workspace_bytes: int = -1  # -1: DEFAULT_WORKSPACE_BYTES of the device
    heap_bytes: int = -1  # -1: DEFAULT_HEAP_BYTES of the device; 0: no heap
    timeout: float = DEFAULT_TIMEOUT_S
    debug: str = ""
    local_world_size: int | None = None
    check: str = "fingerprint"
    channels: int = 0  # 0: auto (gpucomm.workspace.engine chooses)
    blocking_wait: bool = False  # Work.wait() on a GPU blocks the host too
    async_error_handling: str = "raise"  # a failure the watchdog finds: raise at the next call, or abort
    status_signal: str = ""  # a signal name (SIGUSR1, ...) that makes a rank print gpucomm.status(); "" = off

    def workspace_bytes_for(self, device_type: str) -> int:
        """Data bytes of a workspace on ``device_type`` ("cpu", "cuda"): the knob, or the device's default.

        The default applies where the knob is unset (``workspace_bytes`` is -1).
        """
        return self.workspace_bytes if self.workspace_bytes >= 0 else DEFAULT_WORKSPACE_BYTES[device_type]

    def heap_bytes_for(self, device_type: str) -> int:
        """Bytes of a symmetric heap on ``device_type``: the knob, or the device's default."""
        return self.heap_bytes if self.heap_bytes >= 0 else DEFAULT_HEAP_BYTES[device_type]

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Config:
        """Read ``GPUCOMM_<NAME>`` for every field, then apply keyword overrides (None = unset).

        Raises TypeError for an unknown keyword, ValueError for a value a knob does not take.
        """
        env = os.environ if env is None else env
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"gpucomm.init_process_group: unknown knob(s) {unknown}; expected some of {sorted(names)}")
        values: dict[str, object] = {}
        for name in names:
            raw = env.get(f"GPUCOMM_{name.upper()}")
            if raw is not None and raw != "":
                values[name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **{k: _parse(k, v) for k, v in values.items()})


def _parse(name: str, value: object) -> object:
    def choice(options: tuple[str, ...]) -> str:
        text = str(value).strip().lower()
        if text not in options:
            raise ValueError(f"gpucomm: GPUCOMM_{name.upper()} must be one of {list(options)}, got {value!r}")
        return text

    if name == "transport":
        return choice(TRANSPORTS)
    if name == "kernels":
        return choice(KERNELS)
    if name == "check":
        return choice(CHECKS)
    if name == "algo":
        text = str(value).strip().lower()
        for item in text.split(","):
            algo = item.partition("=")[2] if "=" in item else item
            if algo.strip() not in ALGOS:
                raise ValueError(
                    f"gpucomm: GPUCOMM_ALGO must name one of {list(ALGOS)} (or family=algo pairs), got {value!r}"
                )
        return text
    if name == "debug":
        return str(value).strip().upper()
    if name == "workspace_bytes":
        size = _parse_bytes(value)
        if size < MIN_WORKSPACE_BYTES:
            raise ValueError(f"gpucomm: GPUCOMM_WORKSPACE_BYTES must be at least {MIN_WORKSPACE_BYTES}, got {size}")
        return size
    if name == "heap_bytes":
        size = _parse_bytes(value)
        if size < 0:
            raise ValueError(f"gpucomm: GPUCOMM_HEAP_BYTES must be 0 (no heap) or more, got {value!r}")
        return size
    if name == "timeout":
        if not isinstance(value, str):
            return check_timeout(value, "init_process_group")
        try:
            return check_timeout(float(value), "init_process_group", "GPUCOMM_TIMEOUT")
        except ValueError:  # not a number, or out of range: the variable's own text in the message
            raise ValueError(
                f"gpucomm.init_process_group: GPUCOMM_TIMEOUT must be a positive number of seconds, finite and at "
                f"most {MAX_TIMEOUT_S:g} (about 292 years), got {value!r}"
            ) from None
    if name == "blocking_wait":
        text = str(value).strip().lower()
        if text not in ("0", "1", "false", "true"):
            raise ValueError(f"gpucomm: GPUCOMM_BLOCKING_WAIT must be 0 or 1, got {value!r}")
        return text in ("1", "true")
    if name == "async_error_handling":
        return choice(ASYNC_ERROR_HANDLING)
    if name == "status_signal":
        text = str(value).strip().upper()
        if text in ("", "OFF", "0"):
            return ""
        # The two signals left to applications: no default action of their own to displace.
        chosen = text if text.startswith("SIG") else f"SIG{text}"
        if chosen not in ("SIGUSR1", "SIGUSR2"):
            raise ValueError(f"gpucomm: GPUCOMM_STATUS_SIGNAL must be off, SIGUSR1 or SIGUSR2, got {value!r}")
        return chosen
    if name == "channels":
        text = str(value).strip().lower()
        if text in ("auto", "0"):
            return 0
        count = int(text) if text.isdigit() else -1
        if not 1 <= count <= MAX_CHANNELS:
            raise ValueError(f"gpucomm: GPUCOMM_CHANNELS must be auto or 1..{MAX_CHANNELS}, got {value!r}")
        return count
    if name == "local_world_size":
        count = int(value)  # type: ignore[call-overload]
        if count < 1:
            raise ValueError(f"gpucomm: GPUCOMM_LOCAL_WORLD_SIZE must be >= 1, got {value!r}")
        return count
    raise AssertionError(name)  # unreachable: from_env checked the names


def check_timeout(value: object, fn: str, name: str = "timeout") -> float:
    """``value`` (a ``datetime.timedelta`` or a number of seconds) in seconds, checked.

    Raises TypeError for another type, and ValueError naming ``fn``, ``name`` and the value for
    one that is not a number of seconds in (0, :data:`MAX_TIMEOUT_S`]: zero, negative, nan,
    infinite or too large (``1e300``, ``10**20``, ``timedelta.max``).
    """
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond float's range
            seconds = math.inf
    else:
        raise TypeError(
            f"gpucomm.{fn}: {name} must be a datetime.timedelta or a number of seconds, got {type(value).__name__}"
        )
    if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
        raise ValueError(
            f"gpucomm.{fn}: {name} must be a positive number of seconds, finite and at most {MAX_TIMEOUT_S:g} "
            f"(about 292 years), got {value!r}"
        )
    return seconds


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _parse_bytes(value: object) -> int:
    """``4096``, ``64K``, ``8M``, ``1G`` (binary units, as nccl-tests reads sizes)."""
    if isinstance(value, int):
        return value
    text = str(value).strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] in _UNITS and text[-1:] != "" else ""
    number = text[: -len(unit)] if unit else text
    try:
        return int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"gpucomm: a byte size like 4096, 64K or 8M was expected, got {value!r}") from None


@dataclass(frozen=True)
class CudaEmulation:
    """``GPUCOMM_CUDA_EMULATE=1``: ``GPUCOMM_KERNELS=cuda`` serves CPU tensors with the CUDA C++
    kernels built for the host (gpucomm.ops.cuda_emulate), as ``TRITON_INTERPRET=1`` makes
    ``GPUCOMM_KERNELS=triton`` serve them.

    ``threads``: threads per block of the host build (``GPUCOMM_CUDA_EMULATE_THREADS``, 64 to 1024,
    default 512 as on a GPU; fewer make CI faster). ``seed``: the blocks' order
    (``GPUCOMM_CUDA_EMULATE_SEED``, default 0); every rank must have the same one, since block c of a
    rank waits for block c of its peers and the blocks of a launch run one after the other.
    """

    enabled: bool = False
    threads: int = 512
    seed: int = 0


# program.cu has thread p signal and wait for rank p of up to 64 (its static_assert).
MIN_EMULATED_THREADS = 64
MAX_EMULATED_THREADS = 1024


@functools.cache
def cuda_emulation() -> CudaEmulation:
    """The process's :class:`CudaEmulation`, read from the environment once, at its first use.

    Raises:
        ValueError: a value the variables do not take.
    """
    return _cuda_emulation(os.environ)


def _cuda_emulation(env: Mapping[str, str]) -> CudaEmulation:
    raw = env.get("GPUCOMM_CUDA_EMULATE", "").strip().lower()
    if raw not in ("", "0", "1", "false", "true"):
        raise ValueError(f"gpucomm: GPUCOMM_CUDA_EMULATE must be 0 or 1, got {raw!r}")
    threads_text = env.get("GPUCOMM_CUDA_EMULATE_THREADS", "").strip() or "512"
    threads = int(threads_text) if threads_text.isdigit() else -1
    if not MIN_EMULATED_THREADS <= threads <= MAX_EMULATED_THREADS:
        raise ValueError(
            f"gpucomm: GPUCOMM_CUDA_EMULATE_THREADS must be {MIN_EMULATED_THREADS}..{MAX_EMULATED_THREADS}, "
            f"got {threads_text!r}"
        )
    seed_text = env.get("GPUCOMM_CUDA_EMULATE_SEED", "").strip() or "0"
    if not seed_text.isdigit() or int(seed_text) >= 1 << 64:
        raise ValueError(f"gpucomm: GPUCOMM_CUDA_EMULATE_SEED must be an integer in [0, 2**64), got {seed_text!r}")
    return CudaEmulation(raw in ("1", "true"), threads, int(seed_text))
