"""``GPUCOMM_DEBUG=INFO``: one line per collective on stderr, saying which path served it."""

from __future__ import annotations

import logging
import sys

import torch

__all__ = ["logger", "enable", "describe_call"]

logger = logging.getLogger("gpucomm")


def enable(level: str) -> None:
    """Send gpucomm's records at ``level`` (INFO, DEBUG, ...) to stderr, once per process.

    Raises ValueError where ``level`` is not a logging level.
    """
    if not level:
        return
    numeric = logging.getLevelName(level)
    if not isinstance(numeric, int):
        raise ValueError(f"gpucomm: GPUCOMM_DEBUG must be a logging level such as INFO or DEBUG, got {level!r}")
    if not any(getattr(h, "_gpucomm", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._gpucomm = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(numeric)


def describe_call(rank: int, fn: str, tensor: torch.Tensor | None, **fields: object) -> str:
    """``gpucomm[rank 0]: all_reduce bytes=4096 dtype=float32 algo=oneshot transport=shm kernels=triton``."""
    parts = [f"gpucomm[rank {rank}]: {fn}"]
    if tensor is not None:
        parts.append(f"bytes={tensor.numel() * tensor.element_size()}")
        parts.append(f"dtype={str(tensor.dtype).removeprefix('torch.')}")
    parts += [f"{k}={v}" for k, v in fields.items()]
    return " ".join(parts)
