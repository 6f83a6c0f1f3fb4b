"""The copies a REDUCE carries (a COPY flagged CARRIED right after it, gpucomm.ops.program.Builder.reduce).

The program kernel (kernels/triton/program.py) runs up to two carried COPYs inside the REDUCE's
loop: in every iteration of the fold, after the fold's loads are issued and before its values are
folded and stored, the channel copies the next share of the bytes of the carried copies it owns
(``quota`` bytes of them), so those loads are in flight beside the fold's link reads instead of
after them; what is left when the fold ends (a channel that owns no byte of the REDUCE, or a
rounding) is copied after it. A carried copy has in-half positions of its own, so channel c moves
the bytes at the positions it owns (granule g is channel g % channels', as for every instruction):
:func:`owned_offset` numbers those bytes 0, 1, ... in order, and the carried bytes of a channel are
the first copy's owned bytes, then the second's.
"""

import triton
import triton.language as tl

from gpucomm._kernels.triton._common import as_pointer

__all__ = ["owned_bytes", "owned_offset", "carry_share"]

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
def _copy_owned(
    v, live, pos, nbytes, dst, src, granule, channel, channels, COPY_ELEM: tl.constexpr, COPY_BYTES: tl.constexpr
):
    """The units at owned bytes ``v`` (where ``live``) of the copy dst = src over [pos, pos + nbytes)."""
    unit = owned_offset(v, pos, nbytes, granule, channel, channels) // COPY_BYTES
    unit = tl.where(live, unit, 0)
    s = as_pointer(src, COPY_ELEM, False)
    d = as_pointer(dst, COPY_ELEM, False)
    # src may be a peer's: .cg, as every load of the program kernel (docs/kernel-contract.md).
    tl.store(d + unit, tl.load(s + unit, mask=live, cache_modifier=".cg"), mask=live)


@triton.jit
def carry_share(
    cursor,
    count,
    owned1,
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
    LANES: tl.constexpr,
):
    """Copy this channel's carried bytes [cursor, cursor + count) (numbered as the module docstring
    says: ``owned1`` of the first copy, then the second's); returns ``cursor + count``."""
    UNITS: tl.constexpr = _CARRY_VECTORS * 16 * LANES // COPY_BYTES
    limit = cursor + count
    for at in range(cursor, limit, UNITS * COPY_BYTES):
        v = at + tl.arange(0, UNITS).to(tl.int64) * COPY_BYTES
        live = v < limit
        first = live & (v < owned1)
        _copy_owned(v, first, pos1, n1, dst1, src1, granule, channel, channels, COPY_ELEM, COPY_BYTES)
        second = live & (v >= owned1)
        _copy_owned(v - owned1, second, pos2, n2, dst2, src2, granule, channel, channels, COPY_ELEM, COPY_BYTES)
    return limit
