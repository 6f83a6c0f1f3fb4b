"""gpucomm.language: communication inside users' own Triton kernels.

Device functions (``@triton.jit``, :mod:`gpucomm.language.core`) that a kernel calls with the
context table a :class:`DeviceContext` hands it, and the host side that builds the table and
turns a kernel's error records into exceptions. docs/language.md is the tutorial.

Example::

    import gpucomm.language as gl

    @triton.jit
    def kernel(ctx, x_ptr, ...):
        e = gl.epoch(ctx, 0)
        ...
        e, ok = gl.barrier(ctx, 0, e, LANES)

    ctx = comm.device_context()
    kernel[(1,)](ctx.table, x, ..., num_warps=4)
    ctx.check("kernel")

The device functions are loaded on first use, so that ``import gpucomm`` imports no Triton.
"""

from __future__ import annotations

import importlib

__all__ = [
    "DeviceContext", "rank", "world", "translate", "load", "store", "stage", "signal", "announce", "wait",
    "barrier", "epoch", "store_epoch",
]  # fmt: skip

_FROM = {"DeviceContext": "gpucomm.language.context"}


def __getattr__(name: str) -> object:
    if name not in __all__:
        raise AttributeError(f"module 'gpucomm.language' has no attribute {name!r}")
    return getattr(importlib.import_module(_FROM.get(name, "gpucomm.language.core")), name)
