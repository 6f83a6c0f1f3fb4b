"""all_gather + matmul with the gather spread through the matmul (kernels/triton/fused_matmul.py)."""

from __future__ import annotations

import torch

from gpucomm.fused._group import check_float, communicator, context

__all__ = ["all_gather_matmul"]


def all_gather_matmul(a_shard: torch.Tensor, b: torch.Tensor, group: object = None) -> torch.Tensor:
    """``all_gather(a_shard) @ b``: every rank's rows of ``a``, in rank order, times this
    rank's ``b``, with the gather of the other ranks' shards overlapped with the matmul of the
    shards already there (asynchronous tensor parallelism's all-gather + column-parallel matmul).

    All ranks in the group must call this simultaneously, with shards of the same shape and dtype
    (``b`` may differ per rank: each rank's own weight shard).

    Two launches: this rank's shard is published (copied to its stage, a flag per chunk), then
    one matmul kernel computes its own shard's tiles first and, for every other shard, waits in
    the kernel for the chunks each tile reads, loading them straight from the peer. fp32
    accumulation, one rounding: equal to ``all_gather_into_tensor`` + ``torch.matmul`` within
    the matmul's tolerance (the order of the K sum differs), not bit for bit.

    Args:
        a_shard: (m, k), fp32, fp16 or bf16, contiguous; at most a stage half (1.5 MiB at the
            default workspace).
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
    nbytes = a_shard.numel() * a_shard.element_size()
    if nbytes > ctx.stage_half_bytes:
        raise ValueError(
            f"gpucomm.fused.{fn}: a_shard has {nbytes} bytes, more than a stage half ({ctx.stage_half_bytes}); raise "
            f"GPUCOMM_WORKSPACE_BYTES (a stage half is 3/16 of it)"
        )
    out = torch.empty((ctx.world_size * m, b.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
    if out.numel() == 0 or k == 0:
        return out.zero_()
    from gpucomm._kernels.triton import fused_matmul

    ctx.launch(fn, *fused_matmul.prepare(ctx, a_shard, b, out))
    return out
