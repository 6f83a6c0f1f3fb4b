"""What the JSON and the headers say about the machine: device name, core count, versions."""

from __future__ import annotations

import os
import platform

import torch

__all__ = ["device_name", "versions"]


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


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{_cpu_model()}, {os.cpu_count()} cores"


def versions() -> dict[str, str | None]:
    found: dict[str, str | None] = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = None
    found["cuda"] = torch.version.cuda
    return found
