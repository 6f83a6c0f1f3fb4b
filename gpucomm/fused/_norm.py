"""all_reduce + residual add + RMSNorm (kernels/triton/fused_norm.py has the arithmetic)."""

from __future__ import annotations

import numbers

import torch

from gpucomm.fused._group import check_float, communicator, context

__all__ = ["all_reduce_residual_rmsnorm", "residual_rmsnorm", "TWO_SHOT_MIN_BYTES"]

# From this size of x the two-shot form runs (algo="auto"): the model (bench/fused_model.py,
# 8 x H100, docs/performance.md) predicts it ahead of the one-shot from 64 tokens of 8192 bf16
# (1 MiB) on; below, the one-shot's single barrier wins. Predicted, not measured.
TWO_SHOT_MIN_BYTES = 1 << 20


def _check(
    fn: str, x: object, residual: object, weight: object, eps: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """The checked [T, H] views of x and residual, the weight and eps, before anything moves."""
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        raise ValueError(
            f"gpucomm.fused.{fn}: x must be a tensor of at least one dimension (..., hidden), got {x!r:.80}"
        )
    check_float(x, fn, "x", x.dim())
    check_float(residual, fn, "residual", x.dim(), like=x)
    if residual.shape != x.shape:
        raise ValueError(
            f"gpucomm.fused.{fn}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}"
        )
    check_float(weight, fn, "weight", 1, like=x)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"gpucomm.fused.{fn}: weight must have x's last dimension {x.shape[-1]}, got {weight.shape[0]}"
        )
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"gpucomm.fused.{fn}: eps must be a non-negative float, got {eps!r}")
    H = x.shape[-1]
    return x.reshape(-1, H), residual.reshape(-1, H), weight, float(eps)


def all_reduce_residual_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    group: object = None,
    algo: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reduce ``x`` over the group's ranks, add ``residual``, RMS-normalise with ``weight``: one
    kernel per call (one piece of rows for up to 256 tokens of 8192 bf16 on a GPU's default
    workspace; a barrier more per stage half beyond).

    All ranks in the group must call this simultaneously, with the same shapes and dtype.

    The reduction is all_reduce's, deterministic by contract (every rank's x folded in rank
    order in fp32, rounded once to the dtype); the rest is the arithmetic of
    :func:`residual_rmsnorm`. So the output's bits equal ``gpucomm.all_reduce(x)`` followed by
    ``residual_rmsnorm`` on every rank and every backend where both run. ``x`` is not changed.

    Args:
        x: (..., hidden), fp32, fp16 or bf16, contiguous: this rank's partial sums.
        residual: x's shape and dtype.
        weight: (hidden,), x's dtype.
        eps: added to the mean square before the square root.
        group: the group (None: the default group).
        algo: ``"oneshot"`` (every rank reduces every row: one barrier), ``"twoshot"`` (each
            rank reduces 1/P of the rows and publishes their sums, then normalises every row:
            two barriers, the two-shot all_reduce's NVLink bytes, 2/7 of the one-shot's at 8
            ranks), or ``"auto"``: two-shot from :data:`TWO_SHOT_MIN_BYTES` of x with at least
            one row per rank. The same bits either way.

    Returns:
        ``(out, new_residual)``, both x's shape and dtype: ``new_residual = all_reduce(x) +
        residual``, ``out = rmsnorm(new_residual) * weight``.

    Raises:
        TypeError / ValueError: bad arguments, before anything moves.
        CommTimeoutError: a rank did not arrive within the group's timeout; the fused ops stay
            failed (the collectives do not) until every rank calls :func:`gpucomm.fused.recover`.

    Example::

        out, residual = gpucomm.fused.all_reduce_residual_rmsnorm(partial, residual, norm.weight, 1e-6)
    """
    fn = "all_reduce_residual_rmsnorm"
    x2, res2, weight, eps = _check(fn, x, residual, weight, eps)
    if algo not in ("auto", "oneshot", "twoshot"):
        raise ValueError(f"gpucomm.fused.{fn}: algo must be 'auto', 'oneshot' or 'twoshot', got {algo!r}")
    comm = communicator(group, fn)
    ctx = context(comm, x, fn)
    T, H = x2.shape
    nbytes = x2.numel() * x2.element_size()
    two_shot = algo == "twoshot" or (algo == "auto" and nbytes >= TWO_SHOT_MIN_BYTES and T >= ctx.world_size)
    row_bytes = H * x.element_size()
    if row_bytes > ctx.stage_half_bytes:
        raise ValueError(
            f"gpucomm.fused.{fn}: a row of {H} x {x.dtype} ({row_bytes} bytes) does not fit a stage half of "
            f"{ctx.stage_half_bytes} bytes; raise GPUCOMM_WORKSPACE_BYTES"
        )
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    if T == 0:
        return out, new_residual
    from gpucomm._kernels.triton import fused_norm

    # Two-shot: a channel takes P rows at a time (one per rank); one-shot: one row at a time.
    channels = max(1, min(-(-T // ctx.world_size) if two_shot else T, ctx.channels))
    launch = fused_norm.prepare_fused(
        ctx, x2, res2, weight, out.view(-1, H), new_residual.view(-1, H), eps, channels, two_shot
    )
    ctx.launch(fn, launch)
    return out, new_residual


def residual_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and RMSNorm of :func:`all_reduce_residual_rmsnorm` without the reduction
    (a local Triton kernel): ``new_residual = round(x + residual)``, ``out =
    round(new_residual * rstd * weight)``, ``rstd = 1 / sqrt(mean(new_residual^2) + eps)``, in
    fp32 with IEEE division and square root, each result rounded once to x's dtype.

    The unfused reference of the fused op: ``gpucomm.all_reduce(x); residual_rmsnorm(x, ...)``
    gives the fused op's bits. CUDA tensors, or CPU tensors under TRITON_INTERPRET=1.

    Returns:
        ``(out, new_residual)``, both x's shape and dtype.
    """
    fn = "residual_rmsnorm"
    x2, res2, weight, eps = _check(fn, x, residual, weight, eps)
    if x.device.type == "cpu":
        from gpucomm.fused._group import _interpreted

        if not _interpreted():
            from gpucomm.errors import UnsupportedError

            raise UnsupportedError(
                f"gpucomm.fused.{fn}: CPU tensors run the Triton kernel only under TRITON_INTERPRET=1"
            )
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    T, H = x2.shape
    if T == 0:
        return out, new_residual
    from gpucomm._kernels.triton import fused_norm

    fused_norm.residual_rmsnorm(x2, res2, weight, out.view(-1, H), new_residual.view(-1, H), eps, programs=min(T, 64))
    return out, new_residual
