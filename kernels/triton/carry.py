"""The copies a REDUCE carries (a COPY flagged CARRIED right after it, gpucomm.ops.program.Builder.reduce).

The program kernel (kernels/triton/program.py) runs up to two carried COPYs inside the REDUCE's
loop: in every iteration of the fold, after the fold's loads are issued and before its values are
folded and stored, the channel copies the next share of the bytes of the carried copies it owns
(``quota`` bytes of them), so those loads are in flight beside the fold's link reads instead of
after them; what is left when the fold ends (a channel that owns no byte of the REDUCE, or a
rounding) is copied after it. A carried copy has in-half positions of its own, so channel c moves
the bytes at the positions it owns (granule g is channel g % channels', as for every instruction):
:func:`owned_offset` numbers those bytes 0, 1, ... in order, and the carried bytes of a channel are
the first copy's owned bytes, then the second's from ``start2`` (:func:`carry_plan`).

ALIGNED (every address, position and the granule a multiple of 16 bytes): the bytes move as 16-byte
vectors, one owned offset computed per vector. Owned bytes 16 apart from a multiple of 16 are one
contiguous, aligned vector (a granule's owned bytes start and end on multiples of 16, but for the
copy's last byte), so shares start on whole vectors: ``start2`` and ``quota`` are multiples of 16.
Without it, the units are COPY_BYTES wide, one owned offset each. On a GPU an owned offset is a few
64-bit divisions, and a unit of 8 bytes per offset, both copies' lanes issued for every unit, made
the loop arithmetic-bound (sm_90 PTX: 48 div.s64 and 32 scalar loads a thread per iteration):
tests/ops/test_triton_aot.py holds the loop to vectors.
"""

import triton
import triton.language as tl

from gpucomm._kernels.triton._common import as_pointer

__all__ = ["owned_bytes", "owned_offset", "carry_plan", "carry_share"]

# 16-byte vectors per thread a carried share moves at once: a COPY's (kernels/triton/program.py).
_CARRY_VECTORS = tl.constexpr(8)


@triton.jit
def _first_owned(pos, nbytes, granule, channel, channels):
    """(this channel's first granule at or after ``pos``'s, where its bytes in [pos, pos + nbytes)
    start, how many of them that granule holds)."""
    g_first = pos // granule
    g0 = g_first + (channel - g_first % channels + channels) % channels
    start0 = tl.maximum(g0 * granule, pos)
    first_len = tl.minimum((g0 + 1) * granule, pos + nbytes) - start0
    return g0, start0, first_len


@triton.jit
def owned_bytes(pos, nbytes, granule, channel, channels):
    """Bytes of [pos, pos + nbytes) in the granules this channel owns (channels.shares' rule)."""
    end = pos + nbytes
    g0, start0, first_len = _first_owned(pos, nbytes, granule, channel, channels)
    last = (end - 1) // granule
    owned = (last - g0) // channels + 1  # granules of this channel that [pos, end) reaches
    tail = tl.maximum((g0 + (owned - 1) * channels + 1) * granule - end, 0)
    total = owned * granule - (start0 - g0 * granule) - tail
    return tl.where((nbytes > 0) & (first_len > 0), total, 0)


@triton.jit
def owned_offset(v, pos, nbytes, granule, channel, channels):
    """The offset from ``pos`` of this channel's ``v``-th owned byte of [pos, pos + nbytes) (a tensor
    of ``v``: meaningful where ``v`` < :func:`owned_bytes`)."""
    g0, start0, first_len = _first_owned(pos, nbytes, granule, channel, channels)
    rest = v - first_len
    later = (g0 + (rest // granule + 1) * channels) * granule + rest % granule - pos
    return tl.where(v < first_len, start0 - pos + v, later)


@triton.jit
def carry_plan(
    pos1,
    n1,
    pos2,
    n2,
    fold_bytes,
    step_bytes,
    granule,
    channel,
    channels,
    COPY_BYTES: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    """How this channel numbers and shares its carried bytes: (owned bytes of the first copy, where
    the second's are numbered from, all of them, the share of a step). ``fold_bytes``: the REDUCE's
    bytes this channel owns; a share for about every ``step_bytes`` of them (one or more steps)."""
    UNIT: tl.constexpr = 16 if ALIGNED else COPY_BYTES
    owned1 = owned_bytes(pos1, n1, granule, channel, channels)
    start2 = tl.cdiv(owned1, UNIT) * UNIT  # the second copy from a whole unit (ALIGNED: a vector)
    total = start2 + owned_bytes(pos2, n2, granule, channel, channels)
    steps = tl.maximum(tl.cdiv(fold_bytes, step_bytes), 1)
    quota = tl.cdiv(tl.cdiv(total, steps), UNIT) * UNIT
    return owned1, start2, total, quota


@triton.jit
def _copy_owned(
    a,
    b,
    pos,
    nbytes,
    dst,
    src,
    granule,
    channel,
    channels,
    COPY_ELEM: tl.constexpr,
    COPY_BYTES: tl.constexpr,
    ALIGNED: tl.constexpr,
    LANES: tl.constexpr,
):
    """This channel's owned bytes [a, b) of the copy dst = src over [pos, pos + nbytes) (``a`` a
    whole unit; ``b`` one too, or the copy's last owned byte's end)."""
    s = as_pointer(src, COPY_ELEM, ALIGNED)
    d = as_pointer(dst, COPY_ELEM, ALIGNED)
    if ALIGNED:
        VEC: tl.constexpr = 16 // COPY_BYTES
        ROWS: tl.constexpr = _CARRY_VECTORS * LANES
        whole = b // 16 * 16
        # Whole vectors as pairs of int64, whatever COPY_BYTES is (as the program kernel's COPY):
        # in units of one byte the kernel spilled 41856 bytes (sm_90a, ptxas 13.4 -v).
        sw = as_pointer(src, tl.int64, True)
        dw = as_pointer(dst, tl.int64, True)
        for at in range(a, whole, ROWS * 16):
            v = at + tl.arange(0, ROWS).to(tl.int64) * 16
            live = v < whole
            # One owned offset per vector: its 16 bytes are contiguous and aligned (module docstring).
            first = tl.where(live, owned_offset(v, pos, nbytes, granule, channel, channels), 0) // 8
            offs = tl.multiple_of(first, 2)[:, None] + tl.arange(0, 2)[None, :]
            # src may be a peer's: .cg, as every load of the program kernel (docs/kernel-contract.md).
            tl.store(dw + offs, tl.load(sw + offs, mask=live[:, None], cache_modifier=".cg"), mask=live[:, None])
        if (a < b) & (whole < b):  # the copy's last bytes, short of a vector
            lane = tl.arange(0, VEC)
            unit = owned_offset(whole, pos, nbytes, granule, channel, channels) // COPY_BYTES + lane
            tail = lane < (b - whole) // COPY_BYTES
            tl.store(d + unit, tl.load(s + unit, mask=tail, cache_modifier=".cg"), mask=tail)
    else:
        UNITS: tl.constexpr = _CARRY_VECTORS * 16 * LANES // COPY_BYTES
        for at in range(a, b, UNITS * COPY_BYTES):
            v = at + tl.arange(0, UNITS).to(tl.int64) * COPY_BYTES
            live = v < b
            unit = tl.where(live, owned_offset(v, pos, nbytes, granule, channel, channels), 0) // COPY_BYTES
            tl.store(d + unit, tl.load(s + unit, mask=live, cache_modifier=".cg"), mask=live)


@triton.jit
def carry_share(
    cursor,
    count,
    owned1,
    start2,
    pos1,
    n1,
    dst1,
    src1,
    pos2,
    n2,
    dst2,
    src2,
    granule,
    channel,
    channels,
    COPY_ELEM: tl.constexpr,
    COPY_BYTES: tl.constexpr,
    ALIGNED: tl.constexpr,
    LANES: tl.constexpr,
):
    """Copy this channel's carried bytes [cursor, cursor + count) (numbered as :func:`carry_plan`
    says: ``owned1`` of the first copy, then the second's from ``start2``), each copy's in a loop of
    its own; returns ``cursor + count``."""
    limit = cursor + count
    _copy_owned(
        cursor,
        tl.minimum(limit, owned1),
        pos1,
        n1,
        dst1,
        src1,
        granule,
        channel,
        channels,
        COPY_ELEM,
        COPY_BYTES,
        ALIGNED,
        LANES,
    )
    _copy_owned(
        tl.maximum(cursor, start2) - start2,
        limit - start2,
        pos2,
        n2,
        dst2,
        src2,
        granule,
        channel,
        channels,
        COPY_ELEM,
        COPY_BYTES,
        ALIGNED,
        LANES,
    )
    return limit
