"""all_gather + matmul with the gather overlapped (gpucomm.fused.all_gather_matmul).

Two launches on one stream, neither of whose programs ever waits for another program of its
own launch:

1. ``ag_publish_kernel`` never waits. Programs ``[0, G)`` push: program g copies chunk g of
   this rank's shard (rows ``[g*m//G, (g+1)*m//G)``) into every peer's gathered buffer (half
   e % 2 of a symmetric buffer of ``world`` shards, at this rank's place), rank + 1 first, then
   rank + 2, ..., then announces ``e + 1`` on channel g to every rank. Each shard crosses NVLink
   once, as in an all_gather. The other programs compute the output tiles of this rank's own
   shard, which need nothing from a peer. Every program < 32 then moves its channels to
   ``e + 1`` (``gl.store_epoch``): only the program that stores a channel's epoch reads it.
2. ``ag_matmul_kernel`` computes the tiles of the other shards, rank - 1's first, then rank -
   2's, ... (the order their pushes reach this rank). A tile of shard p's rows waits only for
   the chunks of p that hold them (``gl.wait`` on channel g for rank p, value ``e + 1``; e is
   one behind the epoch launch 1 left), then reads them from the local gathered buffer. It
   never signals: it pushes nothing.

Progress does not depend on which blocks a GPU makes resident, or in what order: launch 1 waits
for nothing, so every rank's launch 1 ends; launch 2's tiles wait only for other ranks' launch
1 (the rule of docs/language.md: blocks of one launch never wait on each other). One more
condition where ranks share a GPU: their launch 2 blocks, spinning, may be resident before a
peer's launch 1 is, and must never fill every SM. So launch 2 is a persistent grid, program i
taking tiles i, i + grid, ...: :func:`grids` sizes it by gpucomm.ops.residency from what a block
of each kernel takes (``FOOTPRINTS``), so that the launch 2 grids of all the ranks on a GPU
leave one SM room for a launch 1 block (tests/fused/test_residency.py). The pushes are
first in launch 1's grid so that a GPU that happens to dispatch in order starts them before the
own shard's tiles (speed, not correctness). What overlaps: this rank's pushes with its own
shard's tiles (launch 1); a late peer's pushes with this rank's tiles of the shards already in
(launch 2, which starts on a shard as soon as its chunks are).

Why a half of the gathered buffer is free when a push writes it. Rank q's half e % 2 is written
by the other ranks' launch 1 of the call at epoch e and read only by q's launch 2 of that call.
The next write into it is rank p's launch 1 at epoch e + 2 (or later), which p's stream runs
after its launch 2 at e + 1 has ended. That launch waited for a chunk of every other rank r
(each chunk holds a row, each row is some tile's), announced with release by r's launch 1 at
e + 1, which r's stream ran after everything r did at e: q had finished reading its half, and
every rank had finished reading what another kernel at e left in a stage half. Where the call
at e + 1 is another kernel on the channels, its barrier at e + 1 gives p the same guarantee
from every rank. The epochs and halves are those of every kernel on the channels
(docs/language.md), so any sequence of them is safe.

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
from gpucomm._kernels.triton.types import COPY_ELEMS, TL_DTYPES
from gpucomm.language import layout
from gpucomm.ops import residency
from gpucomm.ops.residency import Footprint

__all__ = ["ag_publish_kernel", "ag_matmul_kernel", "prepare", "grids", "matmul_grid", "CHUNKS", "FOOTPRINTS"]

# Chunks of a shard, each pushed by a program of its own with a flag of its own (a tile waits
# only for the rows it reads): 16 programs, the share of the SMs the model assumes saturates
# NVLink (docs/performance.md), at most the channels of the device API.
CHUNKS = 16
_NUM_WARPS = 4
_LANES = 32 * _NUM_WARPS
_CHANNELS = tl.constexpr(layout.CHANNEL_SLOTS)
# What a block of each launch takes, by dtype: the kernels compiled for sm_90 by Triton 3.9 on
# the CPU machine at the largest tiles (64 x 64 x 32, 4 warps, m = n = k = 8192): registers as
# ptxas allocates them, static plus dynamic shared memory (tests/support/residency.py reads them;
# tests/fused/test_residency.py fails where a kernel takes more than is written here). Launch 2's
# loop over tiles takes 211 to 255 registers where one tile a program took 128: 2 of its blocks
# an SM instead of 4, a cost a GPU measurement is to weigh.
FOOTPRINTS = {
    ("publish", "bfloat16"): Footprint(threads=_LANES, registers=94, shared=25600),
    ("matmul", "bfloat16"): Footprint(threads=_LANES, registers=211, shared=17408),
    ("publish", "float16"): Footprint(threads=_LANES, registers=94, shared=25600),
    ("matmul", "float16"): Footprint(threads=_LANES, registers=250, shared=17408),
    ("publish", "float32"): Footprint(threads=_LANES, registers=94, shared=33792),
    ("matmul", "float32"): Footprint(threads=_LANES, registers=255, shared=33792),
}


@triton.jit
def _push(
    ctx,
    g,
    e,
    a_addr,
    stage_addr,
    stage_half,
    m,
    k,
    G: tl.constexpr,
    COPY: tl.constexpr,
    ELEM: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    LANES: tl.constexpr,
):
    """Chunk g of this rank's shard into every peer's gathered buffer, then ``e + 1`` announced
    on channel g."""
    me = gl.rank(ctx)
    P = gl.world(ctx)
    lo = tl.cast(g * m // G, tl.int64) * k
    hi = tl.cast((g + 1) * m // G, tl.int64) * k
    src = a_addr.to(tl.pointer_type(COPY))
    mine = (stage_addr + (e & 1) * stage_half + tl.cast(me, tl.int64) * m * k * ELEM).to(tl.pointer_type(COPY))
    if ALIGNED:
        # The stage and its halves are 16-byte aligned (prepare's contract) and so is a shard's size:
        # said, the pushes into the peers store 16-byte vectors (sm_90 PTX, bf16: 8 st.global.b16 a
        # thread a step without it, stage_half being an unspecialised argument).
        mine = tl.multiple_of(mine, 16)
    for step in range(1, P):
        dst = gl.translate(mine, (me + step) % P, ctx)  # rank me + 1 first: its tiles want this shard first
        for s in range(lo, hi, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < hi), mask=offs < hi)
    gl.announce(ctx, g, e + 1, LANES)


@triton.jit
def _tile(
    a,
    ok,
    b_ptr,
    c_ptr,
    p,
    t,
    m,
    n,
    k,
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Tile t of shard p (at ``a``, [m, k]) times b into out's rows of shard p; zeros where
    ``ok`` is False (a wait gave up: the launch's results are undefined)."""
    tiles_n = tl.cdiv(n, BLOCK_N)
    row0 = t // tiles_n * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = t % tiles_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if ALIGNED:
        # 16-byte aligned (this rank's shard; a shard of a multiple of 16 bytes in the aligned
        # gathered buffer, whose computed address the compiler cannot prove so).
        a = tl.multiple_of(a, 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if ok:
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                a + rows[:, None].to(tl.int64) * k + ks[None, :],
                mask=(rows[:, None] < m) & (ks[None, :] < k),
                other=0.0,
            )
            y = tl.load(
                b_ptr + ks[:, None].to(tl.int64) * n + cols[None, :],
                mask=(ks[:, None] < k) & (cols[None, :] < n),
                other=0.0,
            )
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
def ag_publish_kernel(
    ctx,  # the DeviceContext's table
    a_ptr,  # this rank's shard, [m, k]
    b_ptr,  # [k, n]
    c_ptr,  # out, [world * m, n]: row p * m + i is row i of rank p's shard times b
    stage_addr,
    stage_half,  # the gathered buffer (symmetric): half e % 2 holds epoch e's world shards
    m,
    n,
    k,
    G: tl.constexpr,  # chunks of a shard: the pushing programs, first in the grid; the own shard's tiles after
    COPY: tl.constexpr,  # the integer type of the element size: pushes move bits
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input precision: "ieee" for fp32
    WIDEN: tl.constexpr,  # 16-bit tiles go to tl.dot as fp32 (the interpreter's 16-bit dot is wrong)
    ALIGNED: tl.constexpr,  # a_ptr and a shard's bytes are multiples of 16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK: tl.constexpr,  # elements a push moves per step
    LANES: tl.constexpr,  # threads of a block: 32 * num_warps
):
    """Launch 1: push this rank's shard and announce it, compute its own tiles; never waits."""
    pid = tl.program_id(0)
    if pid < G:
        e = gl.epoch(ctx, pid)  # its own channel's, where the last launch left it
        _push(
            ctx,
            pid,
            e,
            a_ptr.to(tl.int64),
            stage_addr,
            stage_half,
            m,
            k,
            G,
            COPY,
            DTYPE.primitive_bitwidth // 8,
            ALIGNED,
            BLOCK,
            LANES,
        )
        gl.store_epoch(ctx, e + 1)
    else:
        _tile(
            a_ptr,
            True,
            b_ptr,
            c_ptr,
            gl.rank(ctx),
            pid - G,
            m,
            n,
            k,
            DTYPE,
            PRECISION,
            WIDEN,
            ALIGNED,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
        if pid < _CHANNELS:  # its channels on with the pushers' (store_epoch: pid, pid + grid, ...)
            gl.store_epoch(ctx, gl.epoch(ctx, pid) + 1)


@triton.jit
def _gathered_tile(
    ctx,
    b_ptr,
    c_ptr,
    stage_addr,
    stage_half,
    e,
    t,
    m,
    n,
    k,
    G: tl.constexpr,
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LANES: tl.constexpr,
):
    """Tile t of the other shards (shard rank - 1's tiles first): wait for the chunks of the
    peer's shard that hold its rows, then compute it from the local gathered buffer."""
    per_shard = tl.cdiv(m, BLOCK_M) * tl.cdiv(n, BLOCK_N)
    P = gl.world(ctx)
    me = gl.rank(ctx)
    p = (me - 1 - t // per_shard + P) % P  # rank me - 1 pushes to this rank first, me - 2 next, ...
    t = t % per_shard
    # Wait for the chunks of p's shard that hold rows [row0, row0 + BLOCK_M).
    row0 = t // tl.cdiv(n, BLOCK_N) * BLOCK_M
    last = tl.minimum(row0 + BLOCK_M, m)
    ok = tl.full((), 1, tl.int1)
    for g in tl.static_range(G):
        if (g * m // G < last) & ((g + 1) * m // G > row0):
            ok = ok & gl.wait(ctx, g, p, e + 1, LANES)
    at = stage_addr + (e & 1) * stage_half + tl.cast(p, tl.int64) * m * k * (DTYPE.primitive_bitwidth // 8)
    _tile(
        at.to(tl.pointer_type(DTYPE)),
        ok,
        b_ptr,
        c_ptr,
        p,
        t,
        m,
        n,
        k,
        DTYPE,
        PRECISION,
        WIDEN,
        ALIGNED,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )


@triton.jit(do_not_specialize=["stage_half"])
def ag_matmul_kernel(
    ctx,
    b_ptr,
    c_ptr,
    stage_addr,
    stage_half,
    m,
    n,
    k,  # as ag_publish_kernel's
    G: tl.constexpr,  # chunks of a shard: one flag each, per rank
    DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
    ALIGNED: tl.constexpr,  # a shard's bytes are a multiple of 16
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LANES: tl.constexpr,
):
    """Launch 2: the other shards' tiles, each waiting for the peer's chunks it reads; never
    signals. A persistent grid: program i takes tiles i, i + grid, i + 2 * grid, ..., so that
    the grid stays within what the GPU holds beside the peers' launch 1 (``prepare``)."""
    per_shard = tl.cdiv(m, BLOCK_M) * tl.cdiv(n, BLOCK_N)
    tiles = (gl.world(ctx) - 1) * per_shard
    e = gl.epoch(ctx, 0) - 1  # launch 1 moved every channel on from the call's epoch
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        _gathered_tile(
            ctx,
            b_ptr,
            c_ptr,
            stage_addr,
            stage_half,
            e,
            t,
            m,
            n,
            k,
            G,
            DTYPE,
            PRECISION,
            WIDEN,
            ALIGNED,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            LANES,
        )


def _block(size: int, cap: int) -> int:
    """A tile side: a power of two, at least 16 (tl.dot's least), at most ``cap``."""
    return max(16, min(cap, triton.next_power_of_2(size)))


def _ranks_on_device(ctx: object) -> int:
    """Ranks that may share this rank's GPU: the node's ranks spread over the visible GPUs (one
    process per GPU gives 1). A process that sees only its own GPU counts every rank of the node
    on it: a smaller grid than needed, never a larger one."""
    if ctx.device.type == "cuda":
        return -(-ctx.world_size // max(1, torch.cuda.device_count()))
    return ctx.world_size  # ranks on shared memory: one host, taken as one GPU


def matmul_grid(tiles: int, dtype: str, ranks: int, limits: residency.SMLimits = residency.H100) -> int:
    """Launch 2's grid for ``tiles`` tiles of the other shards in ``dtype`` (its name), ``ranks``
    ranks on the GPU: every rank's launch 2 together leaves one SM room for a block of a peer's
    launch 1, whatever blocks the GPU made resident first (gpucomm.ops.residency)."""
    return residency.spinning_grid(tiles, FOOTPRINTS["matmul", dtype], FOOTPRINTS["publish", dtype], ranks, limits)


def grids(
    m: int, n: int, world: int, dtype: str, ranks: int, limits: residency.SMLimits = residency.H100
) -> tuple[int, int]:
    """(launch 1's grid, launch 2's) for shards of ``m`` rows times ``n`` columns in ``dtype`` (its
    name) among ``world`` ranks, ``ranks`` of them on this GPU; launch 2's is 0 for one rank."""
    tiles = triton.cdiv(m, _block(m, 64)) * triton.cdiv(n, _block(n, 64))  # per shard
    publish = min(CHUNKS, m) + tiles
    return publish, (matmul_grid((world - 1) * tiles, dtype, ranks, limits) if world > 1 else 0)


def prepare(
    ctx: object,
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    stage_addr: int,
    stage_half: int,
    matmul_blocks: int | None = None,
) -> tuple[Callable[[], None], ...]:
    """The launches, in stream order, on ``a`` [m, k], ``b`` [k, n], ``out`` [world * m, n]
    (checked by the caller) with the context ``ctx``, gathering into the symmetric buffer at
    ``stage_addr`` (two halves of ``stage_half`` >= world * m * k elements' bytes, 16-byte
    aligned): ``ag_publish_kernel``, then ``ag_matmul_kernel`` where there are other ranks, on
    :func:`matmul_grid`'s grid (``matmul_blocks``, fewer, makes its programs loop more: tests)."""
    m, k = a.shape
    n = b.shape[1]
    size = a.element_size()
    chunks = min(CHUNKS, m)
    bm, bn, bk = _block(m, 64), _block(n, 64), _block(k, 32)
    common = dict(
        G=chunks, DTYPE=TL_DTYPES[a.dtype], WIDEN=INTERPRETED,
        PRECISION="ieee" if a.dtype == torch.float32 or INTERPRETED else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, LANES=_LANES, num_warps=_NUM_WARPS,
    )  # fmt: skip
    limits = residency.limits_of(ctx.device) if ctx.device.type == "cuda" else residency.H100
    publish_grid, grid = grids(m, n, ctx.world_size, str(a.dtype).removeprefix("torch."), _ranks_on_device(ctx), limits)
    publish = functools.partial(
        ag_publish_kernel[(publish_grid,)], ctx.table, a, b, out, stage_addr, stage_half, m, n, k,
        COPY=COPY_ELEMS[size], ALIGNED=a.data_ptr() % 16 == 0 and m * k * size % 16 == 0, BLOCK=_LANES * 16 // size,
        **common,
    )  # fmt: skip
    if ctx.world_size == 1:
        return (publish,)
    if matmul_blocks is not None:
        grid = max(1, min(grid, matmul_blocks))
    gathered = functools.partial(
        ag_matmul_kernel[(grid,)], ctx.table, b, out, stage_addr, stage_half, m, n, k,
        ALIGNED=m * k * size % 16 == 0, **common,
    )  # fmt: skip
    return publish, gathered
