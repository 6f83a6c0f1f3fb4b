"""Opening a symmetric workspace: the checks every transport shares, then the transport's own.

Its own module so that the transports import :mod:`gpucomm.transport.workspace` and this module
imports them, with no circle between them. (CuPy is imported only when cuda_ipc is opened.)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from gpucomm.transport.cuda_ipc import open_cuda_ipc
from gpucomm.transport.shm import open_shm
from gpucomm.transport.workspace import Handshake, Workspace

__all__ = ["open_workspace"]


def open_workspace(
    kind: str,
    *,
    store: torch.distributed.Store,
    prefix: str,
    rank: int,
    world_size: int,
    data_bytes: int,
    flag_count: int,
    device: torch.device,
    timeout: float,
    size_knob: str = "GPUCOMM_WORKSPACE_BYTES",
    views_keep_memory: bool = False,
    agree: Mapping[str, int | str] | None = None,
) -> Workspace:
    """Open the symmetric workspace of ``kind`` ("shm" or "cuda_ipc") on every rank.

    All ranks must call this simultaneously with the same ``prefix``, ``world_size``,
    ``data_bytes`` and ``flag_count``; the prefix must not have been used by an earlier open.
    Flags are all zero when it returns. ``size_knob`` is the knob a user lowers to make the
    buffers smaller (named in the advice of a /dev/shm without room). Closing it gives its
    memory back at once, whoever still views it, unless ``views_keep_memory`` (the symmetric
    heap: a segment the caller's tensors view stays until the last of them is freed; shm only,
    a CUDA IPC allocation is freed at close). ``agree``: values every rank must share that the
    buffers' sizes do not show (the channels of the flag layout), compared before any buffer is
    made (:meth:`Handshake.agree`).

    Raises:
        CommTimeoutError: a peer did not publish its handle (or did not open) within ``timeout``.
        WorkspaceUnavailableError: some rank could not make its buffer or open a peer's for a
            reason of the host's (a full /dev/shm, no shared /dev/shm or IPC namespace, no CuPy,
            GPUs without peer access): every rank raises it, at the same step.
        GpucommError: a peer published a malformed or mismatched handle (every rank raises).
        CommMismatchError: the ranks passed different ``agree`` values (every rank raises).
    """
    for name, value in (
        ("rank", rank),
        ("world_size", world_size),
        ("data_bytes", data_bytes),
        ("flag_count", flag_count),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"open_workspace: {name} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"open_workspace: need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    if data_bytes < 0 or flag_count < 0 or data_bytes + flag_count == 0:
        raise ValueError(
            f"open_workspace: need data_bytes >= 0 and flag_count >= 0, not both 0; got "
            f"data_bytes={data_bytes} flag_count={flag_count}"
        )
    if not isinstance(prefix, str):
        raise TypeError(f"open_workspace: prefix must be a str, got {type(prefix).__name__}")
    if not timeout > 0:
        raise ValueError(f"open_workspace: timeout must be > 0 seconds, got {timeout!r}")
    device = torch.device(device)
    handshake = Handshake(store, prefix, rank, world_size, float(timeout), transport=kind)
    if agree:
        handshake.agree(agree)
    if kind == "shm":
        return open_shm(
            handshake,
            data_bytes=data_bytes,
            flag_count=flag_count,
            device=device,
            size_knob=size_knob,
            views_keep_memory=views_keep_memory,
        )
    if kind == "cuda_ipc":
        return open_cuda_ipc(handshake, data_bytes=data_bytes, flag_count=flag_count, device=device)
    raise ValueError(f"open_workspace: kind must be 'shm' or 'cuda_ipc', got {kind!r}")
