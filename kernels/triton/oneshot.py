"""The one-shot all_reduce written with gpucomm.language: gpucomm's own first user of its device API.

Per piece of up to one stage half: every rank copies its piece into its stage (the half of the
current epoch), meets every rank at a barrier, then folds every rank's piece in rank order, in
the accumulation type, divides once for AVG, rounds once and writes the result over its tensor.
The numerics are the program kernel's REDUCE (the same helpers of ``_common``), so the bits equal
the program kernel's one-shot: an element's result depends on its inputs alone.

Program c of the grid is channel c: of every piece it moves the elements of its share only
(the same share on every rank, whole 16-byte vectors), and meets only channel c of the other
ranks. Every channel runs every piece (a barrier each, even with an empty share), so all
channels count the same epochs, and ``store_epoch`` keeps the channels a smaller grid lacks in
step: every launch starts every channel at one epoch and so one stage half.
"""

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import gpucomm.language as gl
from gpucomm._kernels.triton._common import OP_AVG, as_pointer, combine, divide, load_acc, store_rounded
from gpucomm._kernels.triton.types import COPY_ELEMS, TL_DTYPES

__all__ = ["oneshot_kernel", "prepare", "NUM_WARPS"]

# One block of 4 warps per channel; a step moves LANES 16-byte vectors.
NUM_WARPS = 4
_LANES = 32 * NUM_WARPS


@triton.jit
def _fold(ctx, staged, out, offs, mask, P, divisor, DTYPE: tl.constexpr, OP: tl.constexpr, ALIGNED: tl.constexpr):
    """Elements ``offs`` of every rank's stage folded in rank order (from rank 0, whichever rank
    this is), divided once for AVG, rounded once into ``out`` (an address)."""
    acc = load_acc(gl.translate(staged, 0, ctx).to(tl.int64), offs, mask, DTYPE, True)
    for p in range(1, P):
        acc = combine(acc, load_acc(gl.translate(staged, p, ctx).to(tl.int64), offs, mask, DTYPE, True), OP)
    if OP == OP_AVG:
        acc = divide(acc, divisor)
    store_rounded(out, offs, acc, mask, DTYPE, ALIGNED)


@triton.jit(do_not_specialize=["n", "piece", "divisor"])
def oneshot_kernel(
    ctx,  # the DeviceContext's table
    x_addr,  # the tensor's address (an int: a repeated call keeps no tensor), reduced in place
    n,  # its elements
    piece,  # elements per piece: a stage half, whole 16-byte vectors
    divisor,  # AVG divides the fold by this once
    DTYPE: tl.constexpr,  # element type
    OP: tl.constexpr,  # gpucomm.ReduceOp value (AVG folds as SUM, then divides)
    COPY: tl.constexpr,  # the integer type of DTYPE's size: the copy-in moves bits
    ELEM: tl.constexpr,  # bytes of DTYPE
    ALIGNED: tl.constexpr,  # x_ptr is 16-byte aligned (the stage always is)
    BLOCK: tl.constexpr,  # elements per step
    LANES: tl.constexpr,  # threads of a block: 32 * num_warps
):
    ch = tl.program_id(0)
    channels = tl.num_programs(0)
    P = gl.world(ctx)
    VEC: tl.constexpr = BLOCK // LANES
    x = x_addr.to(tl.int64)
    e = gl.epoch(ctx, ch)
    ok = tl.full((), 1, tl.int1)
    for start in range(0, n, piece):
        count = tl.minimum(piece, n - start)
        share = tl.cdiv(tl.cdiv(count, channels), VEC) * VEC
        # [lo, hi): this channel's share; lo is a whole number of vectors from the piece's start.
        lo = tl.multiple_of(tl.minimum(ch * share, tl.cdiv(count, VEC) * VEC), VEC)
        hi = tl.minimum(lo + share, count)
        # Whole vectors up to body, masked by vector (16-byte loads and stores), then the tail.
        body = tl.multiple_of(tl.maximum(hi // VEC * VEC, lo), VEC)
        # In 64 bits: n and piece are int32 below 2**31 elements, and a tensor of more than 2 GiB
        # has pieces past 2**31 bytes (the i32 product wrapped: tests/language/test_language_aot.py).
        x_piece = x + tl.cast(start, tl.int64) * ELEM
        mine = gl.stage(ctx, e, COPY)
        src = as_pointer(x_piece, COPY, ALIGNED)
        for s in range(lo, body, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            tl.store(mine + offs, tl.load(src + offs, mask=offs < body), mask=offs < body)
        if body < hi:  # the tensor's last elements, short of a vector
            tail = body + tl.arange(0, VEC)
            tl.store(mine + tail, tl.load(src + tail, mask=tail < hi), mask=tail < hi)
        e, arrived = gl.barrier(ctx, ch, e, LANES)
        ok = ok & arrived
        if ok:
            staged = gl.stage(ctx, e - 1, DTYPE)
            for s in range(lo, body, BLOCK):
                offs = s + tl.arange(0, BLOCK)
                _fold(ctx, staged, x_piece, offs, offs < body, P, divisor, DTYPE, OP, ALIGNED)
            if body < hi:
                tail = body + tl.arange(0, VEC)
                _fold(ctx, staged, x_piece, tail, tail < hi, P, divisor, DTYPE, OP, ALIGNED)
    gl.store_epoch(ctx, e)


def prepare(
    ctx: object, addr: int, n: int, dtype: torch.dtype, op: int, divisor: int, channels: int = 1
) -> Callable[[], None]:
    """The launch of :func:`oneshot_kernel` on the ``n`` elements of ``dtype`` (one of the six
    native dtypes) at ``addr``, with the context ``ctx`` (a :class:`gpucomm.language.DeviceContext`)
    on ``channels`` programs, every argument packed once: calling the result launches it."""
    size = dtype.itemsize
    if n == 0:
        return lambda: None
    return functools.partial(
        oneshot_kernel[(channels,)],
        ctx.table, addr, n, ctx.stage_half_bytes // size, divisor,
        DTYPE=TL_DTYPES[dtype], OP=op, COPY=COPY_ELEMS[size], ELEM=size, ALIGNED=addr % 16 == 0,
        BLOCK=_LANES * (16 // size), LANES=_LANES, num_warps=NUM_WARPS,
    )  # fmt: skip
