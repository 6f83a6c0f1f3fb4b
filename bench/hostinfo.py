"""What the JSON and the headers say about the machine and the run.

The device name, core count, versions, and the settings every benchmark's JSON starts with.

torch is imported where it is used, not here: a benchmark's ranks import their module before
they set what must be set before torch or triton is imported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["device_name", "versions", "run_settings", "write_json"]


def _cpu_model() -> str:
    # platform.processor() is empty on many Linux hosts; /proc/cpuinfo names the part.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_name() -> str:
    return f"{_cpu_model()}, {os.cpu_count()} cores"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return _cpu_name()


def versions() -> dict[str, str | None]:
    import torch

    found: dict[str, str | None] = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = None
    found["cuda"] = torch.version.cuda
    return found


def run_settings(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """A run's settings as its JSON keeps them, then ``extra``.

    The options, the command line, the thread count the ranks were started with (None: torch's
    default, one thread per core), the host, its cores, the versions and the date.
    """
    return {
        **vars(args),
        "argv": sys.argv[1:],
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "host": socket.gethostname(),
        "cpu": _cpu_name(),
        "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def write_json(path: str, settings: dict[str, Any], **results: Any) -> None:
    """``{"settings": settings, **results}`` into ``path``."""
    with open(path, "w") as f:
        json.dump({"settings": settings, **results}, f, indent=1)
