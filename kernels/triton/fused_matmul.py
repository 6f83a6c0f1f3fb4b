"""all_gather + matmul with the gather overlapped (gpucomm.fused.all_gather_matmul).

One kernel does both (``ag_matmul_kernel``), then a one-program kernel advances the epochs:

- programs ``[0, G)`` push: program g copies chunk g of this rank's shard (rows
  ``[g*m//G, (g+1)*m//G)``) into every peer's gathered buffer (half e % 2 of a symmetric buffer
  of ``world`` shards, at this rank's place), rank + 1 first, then rank + 2, ..., then announces
  ``e + 1`` on channel g to every rank. They never wait. Each shard crosses NVLink once, as in
  an all_gather.
- programs ``[G, G + tiles)`` compute output tiles, this rank's own shard first, then rank - 1's,
  rank - 2's, ... (the order their pushes reach it): a tile of this rank's rows reads its shard
  and waits for nothing; a tile
  of shard p's rows waits only for the chunks of p that hold them (``gl.wait`` on channel g for
  rank p), then reads them from the local gathered buffer. The own shard's tiles compute while
  the peers' pushes arrive, and each shard's tiles start as soon as its chunks are in.

The pushing programs come first in the grid, so they start first (the interpreter runs programs
in order; a GPU dispatches them in order): a tile only ever waits for another rank's pushing
programs, which wait for nothing. Nothing stores an epoch during the launch (every program reads
the one the last launch left); ``advance_kernel``, next on the stream, moves every channel on.

Why a half of the gathered buffer is free when a push writes it: it was last written two epochs
back and read by the tiles of that call; this rank's launch of this call comes after its launch
of the last call, whose tiles waited for every rank's pushes of that call, which each rank made
only after its own launch of the call before had ended (stream order). The same epochs and
halves as every kernel on the channels (docs/language.md).

Numerics: fp32 accumulation of ``tl.dot`` over K in BLOCK_K steps, rounded once to the output
dtype (fp32 inputs at IEEE precision, no TF32): equal to ``all_gather`` then ``torch.matmul``
within the matmul's own tolerance, not bit for bit (the order of K differs). Under the
interpreter 16-bit tiles are widened to fp32 before ``tl.dot``: its dot of bf16 tiles is wrong
(Triton 3.9: an error of 2.8e10 on a 16 x 16 product of randn values, loads checked exact),
and the product of two 16-bit floats is exact in fp32, as the GPU's MMA computes it.
"""

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

import gpucomm.language as gl
from gpucomm._kernels.triton._common import store_rounded
from gpucomm._kernels.triton.clock import INTERPRETED

__all__ = ["ag_matmul_kernel", "advance_kernel", "prepare", "CHUNKS"]

# Chunks of a shard, each pushed by a program of its own with a flag of its own (a tile waits
# only for the rows it reads): 16 programs, the share of the SMs the model assumes saturates
# NVLink (docs/performance.md), at most the channels of the device API.
CHUNKS = 16
_NUM_WARPS = 4
_LANES = 32 * _NUM_WARPS
_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_COPY_ELEMS = {4: tl.int32, 2: tl.int16}


@triton.jit
def _push(ctx, g, e, a_addr, stage_addr, stage_half, m, k, G: tl.constexpr, COPY: tl.constexpr, ELEM: tl.constexpr, BLOCK: tl.constexpr, LANES: tl.constexpr):
    """Chunk g of this rank's shard into every peer's gathered buffer, then ``e + 1`` announced
    on channel g."""
    me = gl.rank(ctx)
    P = gl.world(ctx)
    lo = tl.cast(g * m // G, tl.int64) * k
    hi = tl.cast((g + 1) * m // G, tl.int64) * k
    src = a_addr.to(tl.pointer_type(COPY))
    mine = (stage_addr + (e & 1) * stage_half + tl.cast(me, tl.int64) * m * k * ELEM).to(tl.pointer_type(COPY))
    for step in range(1, P):
        dst = gl.translate(mine, (me + step) % P, ctx)  # rank me + 1 first: its tiles want this shard first
        for s in range(lo, hi, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < hi), mask=offs < hi)
    gl.announce(ctx, g, e + 1, LANES)


@triton.jit
def _tile(
    ctx, t, e, a_ptr, b_ptr, c_ptr, stage_addr, stage_half, m, n, k,
    G: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LANES: tl.constexpr,
):
    """Output tile t: this rank's own shard's tiles first, then the previous ranks', in the
    order their pushes arrive."""
    tiles_n = tl.cdiv(n, BLOCK_N)
    tiles_m = tl.cdiv(m, BLOCK_M)  # per shard
    order = t // (tiles_m * tiles_n)
    tm = t // tiles_n % tiles_m
    tn = t % tiles_n
    P = gl.world(ctx)
    me = gl.rank(ctx)
    p = (me - order + P) % P  # rank me - 1 pushes to this rank first, me - 2 next, ...
    row0 = tm * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = tl.full((), 1, tl.int1)
    if p != me:
        # Wait for the chunks of p's shard that hold rows [row0, row0 + BLOCK_M).
        last = tl.minimum(row0 + BLOCK_M, m)
        for g in tl.static_range(G):
            if (g * m // G < last) & ((g + 1) * m // G > row0):
                ok = ok & gl.wait(ctx, g, p, e + 1, LANES)
        at = stage_addr + (e & 1) * stage_half + tl.cast(p, tl.int64) * m * k * (DTYPE.primitive_bitwidth // 8)
        a = at.to(tl.pointer_type(DTYPE))
    else:
        a = a_ptr
    if ALIGNED:
        # Both 16-byte aligned (this rank's shard; a shard of a multiple of 16 bytes in an
        # aligned buffer): said after the branch, whose merge forgets it.
        a = tl.multiple_of(a, 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if ok:
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(a + rows[:, None].to(tl.int64) * k + ks[None, :], mask=(rows[:, None] < m) & (ks[None, :] < k), other=0.0)
            y = tl.load(b_ptr + ks[:, None].to(tl.int64) * n + cols[None, :], mask=(ks[:, None] < k) & (cols[None, :] < n), other=0.0)
            if WIDEN:
                x = x.to(tl.float32)
                y = y.to(tl.float32)
            acc = tl.dot(x, y, acc, input_precision=PRECISION)
    out = c_ptr.to(tl.int64) + (tl.cast(p * m, tl.int64) + row0) * n * (DTYPE.primitive_bitwidth // 8)
    offs = (rows - row0)[:, None].to(tl.int64) * n + cols[None, :]
    store_rounded(out, offs, acc, (rows[:, None] < m) & (cols[None, :] < n), DTYPE, False)


# m, n and k specialise (divisibility by 16, as Triton's matmul tutorial lets them): tiles of
# 16-byte rows load as vectors. A model has a few shapes.
@triton.jit(do_not_specialize=["stage_half"])
def ag_matmul_kernel(
    ctx,  # the DeviceContext's table
    a_ptr,  # this rank's shard, [m, k]
    b_ptr,  # [k, n]
    c_ptr,  # out, [world * m, n]: row p * m + i is row i of rank p's shard times b
    stage_addr, stage_half,  # the gathered buffer (symmetric): half e % 2 holds epoch e's world shards
    m, n, k,
    G: tl.constexpr,  # chunks of a shard: the pushing programs, first in the grid
    COPY: tl.constexpr,  # the integer type of the element size: pushes move bits
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" for fp32
    WIDEN: tl.constexpr,  # 16-bit tiles go to tl.dot as fp32 (the interpreter's 16-bit dot is wrong)
    ALIGNED: tl.constexpr,  # a_ptr and a shard's bytes are multiples of 16
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK: tl.constexpr,  # elements a push moves per step
    LANES: tl.constexpr,  # threads of a block: 32 * num_warps
):
    pid = tl.program_id(0)
    e = gl.epoch(ctx, 0)  # every channel's, where the last launch left it
    if pid < G:
        _push(ctx, pid, e, a_ptr.to(tl.int64), stage_addr, stage_half, m, k, G, COPY, DTYPE.primitive_bitwidth // 8, BLOCK, LANES)
    else:
        _tile(ctx, pid - G, e, a_ptr, b_ptr, c_ptr, stage_addr, stage_half, m, n, k, G, DTYPE, PRECISION, WIDEN, ALIGNED, BLOCK_M, BLOCK_N, BLOCK_K, LANES)


@triton.jit
def advance_kernel(ctx):
    """After ag_matmul_kernel: every channel one epoch on (one program)."""
    gl.store_epoch(ctx, gl.epoch(ctx, 0) + 1)


def _block(size: int, cap: int) -> int:
    """A tile side: a power of two, at least 16 (tl.dot's least), at most ``cap``."""
    return max(16, min(cap, triton.next_power_of_2(size)))


def prepare(
    ctx: object, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, stage_addr: int, stage_half: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The two launches (the fused kernel, the epochs' advance) on ``a`` [m, k], ``b`` [k, n],
    ``out`` [world * m, n] (checked by the caller) with the context ``ctx``, gathering into the
    symmetric buffer at ``stage_addr`` (two halves of ``stage_half`` >= world * m * k elements'
    bytes, 16-byte aligned)."""
    m, k = a.shape
    n = b.shape[1]
    size = a.element_size()
    chunks = min(CHUNKS, m)
    bm, bn, bk = _block(m, 64), _block(n, 64), _block(k, 32)
    grid = (chunks + ctx.world_size * triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    fused = functools.partial(
        ag_matmul_kernel[grid], ctx.table, a, b, out, stage_addr, stage_half, m, n, k,
        G=chunks, COPY=_COPY_ELEMS[size], DTYPE=_TL[a.dtype], PRECISION="ieee" if a.dtype == torch.float32 or INTERPRETED else "tf32",
        WIDEN=INTERPRETED, ALIGNED=a.data_ptr() % 16 == 0 and m * k * size % 16 == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK=_LANES * 16 // size, LANES=_LANES, num_warps=_NUM_WARPS,
    )  # fmt: skip
    advance = functools.partial(advance_kernel[(1,)], ctx.table, num_warps=1)
    return fused, advance
