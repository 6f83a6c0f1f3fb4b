"""all_gather + matmul with the gather overlapped (gpucomm.fused.all_gather_matmul): two launches.

1. ``publish_kernel`` (``G`` programs): program g copies chunk g of this rank's shard (rows
   ``[g*m//G, (g+1)*m//G)``) into half e % 2 of a symmetric staging buffer (the context's stage,
   or a heap buffer for shards larger than a stage half), then announces ``e + 1`` on channel g
   to every rank. It never waits.
2. ``matmul_kernel`` (one program per output tile, this rank's own shard first, then the
   next ranks' in ring order): a tile of shard p's rows waits only for the chunks of p that
   hold them (``gl.wait`` on channel g for rank p), then loads them straight from p's stage
   (``gl.translate``) as it goes along K. Tiles of shards already published compute while the
   later shards are still being published, and the remote loads of one tile overlap the
   arithmetic of the others: the gather is spread through the matmul.

Why a stage half is free when publish writes it: it was last written two epochs back and read
by the matmul of that call, and every rank's matmul of the last call waited for every rank's
publish of it, which each rank issued only after its own matmul of the call before had ended
(stream order). The same epochs and halves as every kernel on the channels (docs/language.md).

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

__all__ = ["publish_kernel", "matmul_kernel", "prepare", "CHUNKS"]

# Chunks of a shard, each with its own flag: a tile waits only for the rows it reads.
CHUNKS = 4
_NUM_WARPS = 4
_LANES = 32 * _NUM_WARPS
_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
_COPY_ELEMS = {4: tl.int32, 2: tl.int16}


@triton.jit(do_not_specialize=["m", "k", "stage_half"])
def publish_kernel(
    ctx,  # the DeviceContext's table
    a_addr,  # this rank's shard, [m, k] contiguous
    stage_addr, stage_half,  # the staging buffer (symmetric): half e % 2 holds epoch e's shard
    m, k,
    COPY: tl.constexpr,  # the integer type of the element size: the copy moves bits
    BLOCK: tl.constexpr,  # elements per step
    LANES: tl.constexpr,  # threads of a block: 32 * num_warps
):
    g = tl.program_id(0)
    G = tl.num_programs(0)
    e = gl.epoch(ctx, g)
    lo = tl.cast(g * m // G, tl.int64) * k
    hi = tl.cast((g + 1) * m // G, tl.int64) * k
    dst = (stage_addr + (e & 1) * stage_half).to(tl.pointer_type(COPY))
    src = a_addr.to(tl.pointer_type(COPY))
    for s in range(lo, hi, BLOCK):
        offs = s + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < hi), mask=offs < hi)
    gl.announce(ctx, g, e + 1, LANES)
    gl.store_epoch(ctx, e + 1)


# m, n and k specialise (divisibility by 16, as Triton's matmul tutorial lets them): tiles of
# 16-byte rows load as vectors. A model has a few shapes.
@triton.jit(do_not_specialize=["stage_half"])
def matmul_kernel(
    ctx,  # the DeviceContext's table (after publish_kernel on this rank)
    a_ptr,  # this rank's shard, [m, k]
    b_ptr,  # [k, n]
    c_ptr,  # out, [world * m, n]: row p * m + i is row i of rank p's shard times b
    stage_addr, stage_half,  # publish_kernel's
    m, n, k,
    G: tl.constexpr,  # chunks of a shard (publish_kernel's grid)
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" for fp32
    WIDEN: tl.constexpr,  # 16-bit tiles go to tl.dot as fp32 (the interpreter's 16-bit dot is wrong)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LANES: tl.constexpr,  # threads of a block: 32 * num_warps
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(n, BLOCK_N)
    tiles_m = tl.cdiv(m, BLOCK_M)  # per shard
    order = pid // (tiles_m * tiles_n)  # 0: this rank's own shard, then the next ranks'
    tm = pid // tiles_n % tiles_m
    tn = pid % tiles_n
    P = gl.world(ctx)
    me = gl.rank(ctx)
    p = (me + order) % P
    e = gl.epoch(ctx, 0)  # publish_kernel left every channel here
    row0 = tm * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = tl.full((), 1, tl.int1)
    if p != me:
        # Wait for the chunks of p's shard that hold rows [row0, row0 + BLOCK_M).
        last = tl.minimum(row0 + BLOCK_M, m)
        for g in tl.static_range(G):
            if (g * m // G < last) & ((g + 1) * m // G > row0):
                ok = ok & gl.wait(ctx, g, p, e, LANES)
        a = gl.translate((stage_addr + ((e - 1) & 1) * stage_half).to(tl.pointer_type(DTYPE)), p, ctx)
    else:
        a = a_ptr
    # Both are 16-byte aligned (a torch allocation; a stage, translated by 16-byte distances);
    # said after the branch, whose merge forgets it.
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


def _block(size: int, cap: int) -> int:
    """A tile side: a power of two, at least 16 (tl.dot's least), at most ``cap``."""
    return max(16, min(cap, triton.next_power_of_2(size)))


def prepare(
    ctx: object, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, stage_addr: int, stage_half: int
) -> tuple[Callable[[], None], Callable[[], None]]:
    """The two launches (publish, matmul) on ``a`` [m, k], ``b`` [k, n], ``out`` [world * m, n]
    (checked by the caller) with the context ``ctx``, staging in the symmetric buffer at
    ``stage_addr`` (two halves of ``stage_half`` bytes, 16-byte multiples)."""
    m, k = a.shape
    n = b.shape[1]
    size = a.element_size()
    chunks = min(CHUNKS, m)
    publish = functools.partial(
        publish_kernel[(chunks,)], ctx.table, a.data_ptr(), stage_addr, stage_half, m, k,
        COPY=_COPY_ELEMS[size], BLOCK=_LANES * 16 // size, LANES=_LANES, num_warps=_NUM_WARPS,
    )  # fmt: skip
    bm, bn, bk = _block(m, 64), _block(n, 64), _block(k, 32)
    grid = (ctx.world_size * triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    matmul = functools.partial(
        matmul_kernel[grid], ctx.table, a, b, out, stage_addr, stage_half, m, n, k,
        G=chunks, DTYPE=_TL[a.dtype], PRECISION="ieee" if a.dtype == torch.float32 or INTERPRETED else "tf32", WIDEN=INTERPRETED,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, LANES=_LANES, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return publish, matmul
