"""``get_kernels``: the kernel implementation for a name (``GPUCOMM_KERNELS``) and a device."""

from __future__ import annotations

import importlib
import os

import torch

from gpucomm.config import cuda_emulation
from gpucomm.errors import UnsupportedError
from gpucomm.ops.contract import Kernels

__all__ = ["get_kernels", "kernels_run_on_cpu", "install", "KERNEL_NAMES"]

KERNEL_NAMES = ("auto", "triton", "cuda", "torch")

_instances: dict[tuple[str, torch.device], Kernels] = {}
# Instances a test or benchmark put in place of a name's own (install).
_installed: set[tuple[str, torch.device]] = set()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernels_run_on_cpu(name: str) -> bool:
    """Whether the kernels ``name`` can serve CPU tensors here (Triton only under the interpreter,
    CUDA C++ only with ``GPUCOMM_CUDA_EMULATE=1``)."""
    return (
        name in ("auto", "torch")
        or (name, torch.device("cpu")) in _installed
        or (name == "triton" and _interpreting())
        or (name == "cuda" and cuda_emulation().enabled)
    )


def _normalise(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(f"gpucomm: kernels for {device} need CUDA, which this torch cannot use")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _resolve(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" or _interpreting() else "torch"
    return name


def resolved_name(name: str, device_type: str) -> str:
    """What kernels ``name`` means for tensors of ``device_type`` here ("auto": triton on CUDA,
    and on CPU torch, or triton under the interpreter), without building them."""
    return _resolve(name, torch.device(device_type))


def _make(name: str, device: torch.device) -> Kernels:
    if name == "torch":
        from gpucomm.ops.reference import TorchKernels

        return TorchKernels()
    if name == "triton":
        if device.type == "cpu" and not _interpreting():
            raise UnsupportedError(
                "gpucomm: kernels=triton on CPU tensors needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 before triton is imported, or use kernels=torch"
            )
        if device.type not in ("cpu", "cuda"):
            raise UnsupportedError(f"gpucomm: kernels=triton supports CUDA devices, got {device}")
        from gpucomm.ops.triton_ops import TritonKernels

        return TritonKernels(device)
    # name == "cuda"
    if device.type == "cpu" and cuda_emulation().enabled:
        # The CUDA C++ kernels built for the host, as the Triton interpreter serves kernels=triton.
        from gpucomm.ops.cuda_emulate import EmulatedCudaKernels

        return EmulatedCudaKernels()
    if device.type != "cuda" or not torch.cuda.is_available():
        raise UnsupportedError(
            f"gpucomm: kernels=cuda needs a CUDA device, got {device} (CUDA available: "
            f"{torch.cuda.is_available()}); use kernels=triton or kernels=torch, or set GPUCOMM_CUDA_EMULATE=1 "
            f"to run the CUDA C++ kernels built for the host on CPU tensors"
        )
    try:
        module = importlib.import_module("gpucomm.ops.cuda_ops")
    except ModuleNotFoundError as exc:
        if exc.name != "gpucomm.ops.cuda_ops":
            raise
        raise UnsupportedError(
            "gpucomm: kernels=cuda is not available in this build (no gpucomm.ops.cuda_ops)"
        ) from exc
    return module.CudaKernels(device)


def install(name: str, device: torch.device | str, kernels: Kernels) -> None:
    """Tests and benchmarks only: serve ``name`` on ``device`` with ``kernels`` in this process from
    now on (the host-only Triton kernels on the tests' driver double,
    :class:`gpucomm.ops.triton_ops.HostOnlyTritonKernels`). Never called by gpucomm itself."""
    key = (name, torch.device(device))
    _instances[key] = kernels
    _installed.add(key)


def get_kernels(name: str, device: torch.device | str) -> Kernels:
    """The kernels ``name`` (auto, triton, cuda, torch) for regions on ``device``, one instance per pair.

    ``auto`` is triton on CUDA, and on CPU torch, or triton when ``TRITON_INTERPRET=1`` is set.
    A name this host cannot serve raises :class:`gpucomm.errors.UnsupportedError`.

    Example::

        >>> get_kernels("torch", torch.device("cpu")).name
        'torch'
    """
    if name not in KERNEL_NAMES:
        raise ValueError(f"get_kernels: name must be one of {KERNEL_NAMES}, got {name!r}")
    device = _normalise(device)
    name = _resolve(name, device)
    key = (name, device)
    if key not in _instances:
        _instances[key] = _make(name, device)
    return _instances[key]
