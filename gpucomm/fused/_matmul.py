"""all_gather + matmul with the gather overlapped with the matmul (kernels/triton/fused_matmul.py)."""

from __future__ import annotations

import torch

from gpucomm.comm.communicator import Communicator
from gpucomm.fused._group import check_float, communicator, context
from gpucomm.language.context import DeviceContext

# Staging halves are whole 16-byte vectors (and heap blocks 512-byte aligned).
_ALIGN = 16

__all__ = ["all_gather_matmul"]


def all_gather_matmul(a_shard: torch.Tensor, b: torch.Tensor, group: object = None) -> torch.Tensor:
    """``all_gather(a_shard) @ b``: every rank's rows of ``a``, in rank order, times this
    rank's ``b``, with the gather of the other ranks' shards overlapped with the matmul of the
    shards already there (asynchronous tensor parallelism's all-gather + column-parallel matmul).

    All ranks in the group must call this simultaneously, with shards of the same shape and dtype
    (``b`` may differ per rank: each rank's own weight shard).

    Two launches on one stream (kernels/triton/fused_matmul.py). The first never waits: it
    pushes this rank's shard into every peer's gathered buffer (a flag per chunk) while its
    other programs compute the tiles of this rank's own shard. The second computes the other
    shards' tiles, each waiting in the kernel only for the peer's chunks it reads, which that
    peer's first launch pushes; so no block ever waits for a block of its own launch, and the
    call completes whatever blocks a GPU runs first. The second launch is a persistent grid
    small enough that, with the other ranks on the same GPU, it always leaves room for a peer's
    first launch (gpucomm.ops.residency). fp32 accumulation, one rounding: equal to
    ``all_gather_into_tensor`` + ``torch.matmul`` within the matmul's tolerance (the order of
    the K sum differs), not bit for bit.

    Args:
        a_shard: (m, k), fp32, fp16 or bf16, contiguous. The world's shards gather in the device
            API's stage where they fit a half (3/16 of GPUCOMM_WORKSPACE_BYTES), else in a
            symmetric heap buffer of twice their size (GPUCOMM_HEAP_BYTES), allocated on first
            use and kept.
        b: (k, n), a_shard's dtype, contiguous.
        group: the group (None: the default group).

    Returns:
        (world_size * m, n) in a_shard's dtype: rows ``[p*m, (p+1)*m)`` are rank p's shard times b.

    Raises:
        TypeError / ValueError: bad arguments, before anything moves.
        CommTimeoutError: a rank did not publish within the group's timeout; the fused ops stay
            failed until every rank calls :func:`gpucomm.fused.recover`.

    Example::

        y = gpucomm.fused.all_gather_matmul(x_shard, w_column_shard)   # (tokens, n / tp)
    """
    fn = "all_gather_matmul"
    check_float(a_shard, fn, "a_shard", 2)
    check_float(b, fn, "b", 2, like=a_shard)
    m, k = a_shard.shape
    if b.shape[0] != k:
        raise ValueError(f"gpucomm.fused.{fn}: b must have a_shard's {k} columns as rows, got shape {tuple(b.shape)}")
    comm = communicator(group, fn)
    ctx = context(comm, a_shard, fn)
    out = torch.empty((ctx.world_size * m, b.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
    if out.numel() == 0 or k == 0:
        return out.zero_()
    from gpucomm._kernels.triton import fused_matmul

    ctx.check(fn)  # before a heap allocation (a collective) of a failed context
    stage_addr, stage_half = _staging(comm, ctx, a_shard)
    ctx.launch(fn, *fused_matmul.prepare(ctx, a_shard, b, out, stage_addr, stage_half))
    return out


def _staging(comm: Communicator, ctx: DeviceContext, a_shard: torch.Tensor) -> tuple[int, int]:
    """Where the shards are gathered: the context's stage where world shards fit a half, else
    two halves of a symmetric heap buffer, kept on the context for the next calls (the largest
    so far: a new size allocates collectively, as every rank calls with the same shapes, in
    order)."""
    nbytes = -(-ctx.world_size * a_shard.numel() * a_shard.element_size() // _ALIGN) * _ALIGN
    if nbytes <= ctx.stage_half_bytes:
        return ctx.stage_addr, ctx.stage_half_bytes
    buffer = ctx.buffers.get("all_gather_matmul")
    if buffer is None or buffer.numel() < 2 * nbytes:
        ctx.buffers.pop("all_gather_matmul", None)
        buffer = ctx.buffers["all_gather_matmul"] = comm.empty(2 * nbytes, dtype=torch.uint8, device=a_shard.device)
    return buffer.data_ptr(), buffer.numel() // 2
