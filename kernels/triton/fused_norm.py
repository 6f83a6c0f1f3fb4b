"""all_reduce + residual add + RMSNorm in one kernel (gpucomm.fused.all_reduce_residual_rmsnorm),
and the same residual add + RMSNorm alone (gpucomm.fused.residual_rmsnorm), which the fused
kernel's output equals bit for bit after gpucomm.all_reduce.

Per row of ``x`` (``T`` rows of ``H``), in fp32, with ``round`` the rounding to the tensors'
dtype (once, to nearest even) and ``wide`` the exact widening back::

    s    = round(fold over ranks, in rank order, of x)   # all_reduce's result, bit for bit
    h    = round(wide(s) + wide(residual))                # the new residual
    rstd = 1 / sqrt(sum(wide(h)^2) / H + eps)             # IEEE division and square root
    out  = round(wide(h) * rstd * wide(weight))

The fused kernel, per piece of rows that fits a stage half: program c (channel c) copies rows
c, c + C, ... of ``x`` into this rank's stage, meets channel c of every rank at a barrier, then
folds those rows of every rank's stage and normalises them. One barrier per piece, one piece
for every shape a stage half holds (the default workspace's: 96 rows of 8192 bf16).
"""

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import gpucomm.language as gl
from gpucomm._kernels.triton._common import (
    as_pointer,
    bf16_bits_to_f32,
    combine,
    f32_to_bf16_bits,
    load_acc,
    store_rounded,
)
from gpucomm._kernels.triton.types import COPY_ELEMS, TL_DTYPES

__all__ = [
    "ar_residual_rmsnorm_kernel", "ar_residual_rmsnorm_twoshot_kernel", "residual_rmsnorm_kernel", "prepare_fused",
    "residual_rmsnorm",
    "rows_per_piece", "num_warps",
]  # fmt: skip


def num_warps(hidden: int) -> int:
    """Warps per row: 8 up to 4096 elements, 16 beyond (8192 fp32 of a row in 16 registers a
    thread, with room for the source being folded)."""
    return 8 if hidden <= 4096 else 16


@triton.jit
def _round_trip(acc, DTYPE: tl.constexpr):
    """``acc`` rounded once to DTYPE and widened back to fp32: what a DTYPE tensor holds."""
    if DTYPE == tl.bfloat16:
        return bf16_bits_to_f32(f32_to_bf16_bits(acc))
    elif DTYPE == tl.float16:
        return acc.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    else:
        return acc


@triton.jit
def _norm_row(
    s,
    row,
    res_addr,
    w_addr,
    out_addr,
    new_res_addr,
    H,
    eps,
    DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Row ``row``: the residual add and RMSNorm of the module docstring, from ``s`` (fp32,
    already DTYPE values), into ``out`` and the new residual. Returns both in fp32 (the new
    residual already a DTYPE value, out before its rounding), for a copy elsewhere."""
    cols = tl.arange(0, BLOCK_H)
    live = cols < H
    at = tl.cast(row, tl.int64) * H * (DTYPE.primitive_bitwidth // 8)
    h = _round_trip(s + load_acc(res_addr + at, cols, live, DTYPE, ALIGNED), DTYPE)
    store_rounded(new_res_addr + at, cols, h, live, DTYPE, ALIGNED)
    h = tl.where(live, h, 0.0)
    mean = tl.math.div_rn(tl.sum(h * h, axis=0), tl.cast(H, tl.float32))
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(mean + eps))
    w = load_acc(w_addr, cols, live, DTYPE, ALIGNED)
    y = h * rstd * w
    store_rounded(out_addr + at, cols, y, live, DTYPE, ALIGNED)
    return h, y


@triton.jit(do_not_specialize=["T", "H", "eps"])
def residual_rmsnorm_kernel(
    s_addr,
    res_addr,
    w_addr,
    out_addr,
    new_res_addr,  # addresses: [T, H] reduced x, residual, [H] weight, outputs
    T,
    H,
    eps,  # rows, hidden size, RMSNorm's epsilon
    DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """The residual add and RMSNorm alone (no communication), program c taking rows c, c + C, ..."""
    if ALIGNED:  # rows of whole 16-byte vectors: masks by vector, so loads and stores are vectors
        H = tl.multiple_of(
            H // (128 // DTYPE.primitive_bitwidth) * (128 // DTYPE.primitive_bitwidth), 128 // DTYPE.primitive_bitwidth
        )
    cols = tl.arange(0, BLOCK_H)
    for row in range(tl.program_id(0), T, tl.num_programs(0)):
        at = tl.cast(row, tl.int64) * H * (DTYPE.primitive_bitwidth // 8)
        s = load_acc(s_addr + at, cols, cols < H, DTYPE, ALIGNED)
        _norm_row(s, row, res_addr, w_addr, out_addr, new_res_addr, H, eps, DTYPE, ALIGNED, BLOCK_H)


@triton.jit(do_not_specialize=["T", "H", "eps", "rows_per_piece"])
def ar_residual_rmsnorm_kernel(
    ctx,  # the DeviceContext's table
    x_addr,
    res_addr,
    w_addr,
    out_addr,
    new_res_addr,  # addresses, as residual_rmsnorm_kernel's (x not reduced yet)
    T,
    H,
    eps,
    rows_per_piece,  # rows a stage half holds
    DTYPE: tl.constexpr,
    COPY: tl.constexpr,  # the integer type of DTYPE's size: the copy-in moves bits
    ALIGNED: tl.constexpr,  # every address and a row's bytes are multiples of 16
    BLOCK_H: tl.constexpr,  # power of two >= H
    LANES: tl.constexpr,  # threads of a block: 32 * num_warps
):
    ch = tl.program_id(0)
    channels = tl.num_programs(0)
    P = gl.world(ctx)
    ELEM: tl.constexpr = DTYPE.primitive_bitwidth // 8
    if ALIGNED:  # rows of whole 16-byte vectors: masks by vector, so loads and stores are vectors
        H = tl.multiple_of(H // (16 // ELEM) * (16 // ELEM), 16 // ELEM)
    cols = tl.arange(0, BLOCK_H)
    live = cols < H
    row_bytes = tl.cast(H, tl.int64) * ELEM
    e = gl.epoch(ctx, ch)
    for first in range(0, T, rows_per_piece):
        rows = tl.minimum(rows_per_piece, T - first)
        mine = gl.stage(ctx, e, COPY)
        src = as_pointer(x_addr + first * row_bytes, COPY, ALIGNED)
        for r in range(ch, rows, channels):
            at = tl.cast(r, tl.int64) * H
            tl.store(mine + at + cols, tl.load(src + at + cols, mask=live), mask=live)
        e, ok = gl.barrier(ctx, ch, e, LANES)
        if ok:
            staged = gl.stage(ctx, e - 1, DTYPE)
            for r in range(ch, rows, channels):
                at = tl.cast(r, tl.int64) * row_bytes
                # Rank order, from rank 0, in fp32, rounded once: all_reduce's bits.
                acc = load_acc(gl.translate(staged, 0, ctx).to(tl.int64) + at, cols, live, DTYPE, ALIGNED)
                for p in range(1, P):
                    acc = combine(
                        acc, load_acc(gl.translate(staged, p, ctx).to(tl.int64) + at, cols, live, DTYPE, ALIGNED), 0
                    )
                _norm_row(
                    _round_trip(acc, DTYPE),
                    first + r,
                    res_addr,
                    w_addr,
                    out_addr,
                    new_res_addr,
                    H,
                    eps,
                    DTYPE,
                    ALIGNED,
                    BLOCK_H,
                )
    gl.store_epoch(ctx, e)


@triton.jit
def _fold_row(ctx, staged, at, cols, live, P, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """Row bytes ``at`` of every rank's stage, folded in rank order from rank 0 in fp32 and
    rounded once to DTYPE (all_reduce's bits), widened back."""
    acc = load_acc(gl.translate(staged, 0, ctx).to(tl.int64) + at, cols, live, DTYPE, ALIGNED)
    for p in range(1, P):
        acc = combine(acc, load_acc(gl.translate(staged, p, ctx).to(tl.int64) + at, cols, live, DTYPE, ALIGNED), 0)
    return _round_trip(acc, DTYPE)


@triton.jit(do_not_specialize=["T", "H", "eps", "rows_per_piece"])
def ar_residual_rmsnorm_twoshot_kernel(
    ctx,  # the DeviceContext's table
    x_addr,
    res_addr,
    w_addr,
    out_addr,
    new_res_addr,  # as ar_residual_rmsnorm_kernel's
    T,
    H,
    eps,
    rows_per_piece,  # rows a stage half holds
    DTYPE: tl.constexpr,
    COPY: tl.constexpr,  # the integer type of DTYPE's size: copies move bits
    ALIGNED: tl.constexpr,  # every address and a row's bytes are multiples of 16
    BLOCK_H: tl.constexpr,  # power of two >= H
    LANES: tl.constexpr,  # threads of a block: 32 * num_warps
):
    """The two-shot form: row r of a piece belongs to rank r % P (which reduces it) and to
    channel (r // P) % C (on every rank, in every phase). Per piece: copy the channel's rows in,
    barrier; reduce this rank's rows (rank order, rounded once: all_reduce's bits) and publish
    the sums in the stage's other half; barrier; every rank normalises every row of the channel
    from its sum, its own or its owner's. Over NVLink each rank reads (P - 1)/P of x's rows and
    (P - 1)/P of the sums: the two-shot all_reduce's bytes, and the same bits as the one-shot."""
    ch = tl.program_id(0)
    channels = tl.num_programs(0)
    P = gl.world(ctx)
    me = gl.rank(ctx)
    ELEM: tl.constexpr = DTYPE.primitive_bitwidth // 8
    if ALIGNED:  # rows of whole 16-byte vectors: masks by vector, so loads and stores are vectors
        H = tl.multiple_of(H // (16 // ELEM) * (16 // ELEM), 16 // ELEM)
    cols = tl.arange(0, BLOCK_H)
    live = cols < H
    row_bytes = tl.cast(H, tl.int64) * ELEM
    e = gl.epoch(ctx, ch)
    for first in range(0, T, rows_per_piece):
        rows = tl.minimum(rows_per_piece, T - first)
        # 1. This channel's rows of x into the stage (half e % 2), for their owners to read.
        mine = gl.stage(ctx, e, COPY)
        src = as_pointer(x_addr + first * row_bytes, COPY, ALIGNED)
        for block in range(ch * P, rows, channels * P):
            for r in range(block, tl.minimum(block + P, rows)):
                at = tl.cast(r, tl.int64) * H
                tl.store(mine + at + cols, tl.load(src + at + cols, mask=live), mask=live)
        e, ok = gl.barrier(ctx, ch, e, LANES)
        # 2. This rank's rows: every rank's x folded, the sum published in half (e + 1) % 2.
        staged = gl.stage(ctx, e - 1, DTYPE)
        sums = gl.stage(ctx, e, DTYPE).to(tl.int64)
        if ok:
            for r in range(ch * P + me, rows, channels * P):
                at = tl.cast(r, tl.int64) * row_bytes
                store_rounded(
                    sums + at, cols, _fold_row(ctx, staged, at, cols, live, P, DTYPE, ALIGNED), live, DTYPE, ALIGNED
                )
        e, arrived = gl.barrier(ctx, ch, e, LANES)
        ok = ok & arrived
        # 3. Every row of the channel normalised from its sum, read from its owner's stage.
        if ok:
            published = gl.stage(ctx, e - 1, DTYPE)
            for block in range(ch * P, rows, channels * P):
                for r in range(block, tl.minimum(block + P, rows)):
                    at = tl.cast(r, tl.int64) * row_bytes
                    s = load_acc(gl.translate(published, r % P, ctx).to(tl.int64) + at, cols, live, DTYPE, ALIGNED)
                    _norm_row(s, first + r, res_addr, w_addr, out_addr, new_res_addr, H, eps, DTYPE, ALIGNED, BLOCK_H)
    gl.store_epoch(ctx, e)


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors) and tensors[0].shape[-1] * tensors[0].element_size() % 16 == 0


def prepare_fused(
    ctx: object,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    new_residual: torch.Tensor,
    eps: float,
    channels: int,
    two_shot: bool,
) -> Callable[[], None]:
    """The launch of :func:`ar_residual_rmsnorm_kernel` (or its two-shot form) on these [T, H]
    tensors (checked by the caller) on ``channels`` programs with the context ``ctx``."""
    T, H = x.shape
    warps = num_warps(H)
    kernel = ar_residual_rmsnorm_twoshot_kernel if two_shot else ar_residual_rmsnorm_kernel
    return functools.partial(
        kernel[(channels,)],
        ctx.table, x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), new_residual.data_ptr(),
        T, H, float(eps), rows_per_piece(ctx.stage_half_bytes, H * x.element_size(), two_shot),
        DTYPE=TL_DTYPES[x.dtype], COPY=COPY_ELEMS[x.element_size()],
        ALIGNED=_aligned(x, residual, weight, out, new_residual),
        BLOCK_H=triton.next_power_of_2(H), LANES=32 * warps, num_warps=warps,
    )  # fmt: skip


def rows_per_piece(stage_half_bytes: int, row_bytes: int, two_shot: bool) -> int:
    """Rows of a piece: a stage half holds their x rows (and, two-shot, the other half their
    sums)."""
    return stage_half_bytes // row_bytes


def residual_rmsnorm(
    s: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    new_residual: torch.Tensor,
    eps: float,
    programs: int,
) -> None:
    """Launch :func:`residual_rmsnorm_kernel` on these [T, H] tensors (checked by the caller)."""
    T, H = s.shape
    residual_rmsnorm_kernel[(programs,)](
        s.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), new_residual.data_ptr(), T, H, float(eps),
        DTYPE=TL_DTYPES[s.dtype], ALIGNED=_aligned(s, residual, weight, out, new_residual),
        BLOCK_H=triton.next_power_of_2(H),
        num_warps=num_warps(H),
    )  # fmt: skip
