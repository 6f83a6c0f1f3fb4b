"""The program kernel: one launch runs a whole collective, its waits included.

A *program* is a list of instructions that every rank of a workspace runs in the same order
(gpucomm/ops/program.py builds them from the algorithms). Each program of the launch grid is one
*channel*: it runs every instruction, but moves only the bytes whose in-half position falls in
the granules it owns (granule g belongs to channel g % channels), and it synchronises only
with the same channel of the other ranks. Channels of one launch never wait for each other, so
nothing depends on which of them are resident (on a GPU) or in which order they run (the
interpreter runs them one after the other).

Instructions (``WORDS`` int64 each):

- ``COPY  nbytes pos 1 operand``: operands[operand] = operands[operand + 1], byte for byte (a
  COPY is one move: its word 3 is always 1);
- ``REDUCE nbytes pos k operand divide divisor flags``: operands[operand] = the fold of the k
  operands after it, in order, in the accumulation type, divided once by ``divisor`` if
  ``divide``, rounded once; with ``STORE_ALSO`` in ``flags`` the same rounded result is also
  stored into operands[operand + k + 1], by the same thread right after the first store (a
  two-shot's fold of my slice, into my half and my tensor: no copy of it afterwards);
- a ``COPY`` with ``CARRIED`` in its word 7 right after a REDUCE (or after such a COPY: two at
  most) is run inside that REDUCE: a share of it in every step of the fold, between the fold's
  loads and its stores (kernels/triton/carry.py), and skipped where the main loop reaches it;
- ``SYNC signal_mask wait_mask fence``: advance this channel's epoch e; if ``fence``, a
  system-scope fence in every thread (the data announced was written by this rank's earlier
  kernels: a symmetric tensor read in place); store the call's identity
  words (tagged with e) into this rank's identity slot of e's parity at every rank in
  ``signal_mask``, release-store ``e << FP_BITS | fingerprint`` into this channel's flag there,
  then acquire-wait until the flag of every rank in ``wait_mask`` reaches epoch e and compare
  the identity words each stored beside it (gpucomm/ops/program.py, "Identity").

``pos`` is the in-half position of the instruction's first byte: the workspace operands of one
instruction share it, so the channel that writes a byte of a half is the one that reads it on
every rank. An operand (``OPERAND_WORDS`` int64) is ``[-1, 0, address]`` (memory of this
process) or ``[rank, round, offset]``: ``offset`` bytes into the half that data of ``round``
lives in, counted in syncs from the start of the launch: half ``(epoch at launch + round) % 2``.

State on the device: the epoch of every channel and a poison word live in the rank's own flag
area (``state_addr``: [poison, epoch of channel 0, epoch of channel 1, ...]); a launch loads
them, advances them and stores them back, so a replayed CUDA graph continues from where the
last launch left off. Every wait ends at its deadline (``clock_ns_lanes``, decided once per
block); a timeout, or a peer's flag at this epoch with another fingerprint (or identity words of
this epoch that are not this call's), writes the
channel's error record (``RECORD_WORDS`` int64 at ``record_addr``: [kind, epoch, instruction,
peer mask, value seen, fingerprint]), sets the poison word and ends the channel; every later
launch sees the poison and does nothing.
"""

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from gpucomm._kernels.triton._common import as_pointer, combine, divide, load_acc, store_rounded
from gpucomm._kernels.triton.carry import carry_plan, carry_share, owned_bytes
from gpucomm._kernels.triton.clock import clock_ns_lanes
from gpucomm._kernels.triton.fence import fence_sys
from gpucomm._kernels.triton.types import COPY_ELEMS, TL_DTYPES

# The instruction set (gpucomm.ops.instruction_set), re-exported for the launcher and the tests.
from gpucomm.ops.instruction_set import (
    CARRIED,
    COPY,
    FP_BITS,
    FP_MASK,
    IDENT_BITS,
    IDENT_TAG_MASK,
    MISMATCH,
    OPERAND_WORDS,
    RECORD_WORDS,
    REDUCE,
    STORE_ALSO,
    SYNC,
    TIMEOUT,
    WORDS,
)
from gpucomm.ops.launch_args import ProgramArgs

__all__ = [
    "program_kernel",
    "launch",
    "prepare",
    "arguments",
    "WORDS",
    "OPERAND_WORDS",
    "COPY",
    "REDUCE",
    "SYNC",
    "STORE_ALSO",
    "CARRIED",
    "FP_BITS",
    "RECORD_WORDS",
    "TIMEOUT",
    "MISMATCH",
]


# The same numbers as the kernels see them (Triton reads only constexpr globals).
_WORDS = tl.constexpr(WORDS)
_OPERAND_WORDS = tl.constexpr(OPERAND_WORDS)
_COPY = tl.constexpr(COPY)
_SYNC = tl.constexpr(SYNC)
_STORE_ALSO = tl.constexpr(STORE_ALSO)
_CARRIED = tl.constexpr(CARRIED)
_REDUCE = tl.constexpr(REDUCE)
_FP_BITS = tl.constexpr(FP_BITS)
_FP_MASK = tl.constexpr(FP_MASK)
_IDENT_BITS = tl.constexpr(IDENT_BITS)
_IDENT_TAG_MASK = tl.constexpr(IDENT_TAG_MASK)
_RECORD_WORDS = tl.constexpr(RECORD_WORDS)
_TIMEOUT = tl.constexpr(TIMEOUT)
_MISMATCH = tl.constexpr(MISMATCH)

# Warps of a channel (a block): 256 threads.
NUM_WARPS = 8
# Sources a REDUCE loads before folding: with 2 vectors each, 8 sources keep 16 loads of 16 bytes
# in flight per thread (64 registers), within the 255 a thread of a 256-thread block can have.
MAX_SOURCES = 8
# 16-byte loads per thread per step: a REDUCE spreads _REDUCE_LOADS over its sources (2 each at
# least), a COPY issues _COPY_VECTORS before storing: 64 KiB (REDUCE) or 32 KiB (COPY) in flight
# per channel. How many it takes to reach the bandwidth of an H100 awaits a GPU measurement.
_REDUCE_LOADS = tl.constexpr(16)
_COPY_VECTORS = tl.constexpr(8)
# Registers a thread may use. By default ptxas (CUDA 13.4, as Triton 3.9 ships it) held the
# kernel to 128 and spilled 148 bytes (sm_90, float32 SUM, 8 sources); allowed 255 it used 174
# and spilled nothing. With the carried copies it uses all 255 and spills 44 bytes (496 while the
# carry moved single words: kernels/triton/carry.py; ptxas -v, sm_90a). A channel is one 256-thread
# block: 255 x 256 still fits an SM's 64 Ki registers, one channel an SM.
MAX_REGISTERS = 255


@triton.jit
def _address(opnd_ptr, index, peers_ptr, e0, half_bytes):
    """The address operand ``index`` names, in this process."""
    peer = tl.load(opnd_ptr + index * _OPERAND_WORDS)
    rnd = tl.load(opnd_ptr + index * _OPERAND_WORDS + 1)
    offset = tl.load(opnd_ptr + index * _OPERAND_WORDS + 2)
    base = tl.load(peers_ptr + tl.maximum(peer, 0))
    in_workspace = base + ((e0 + rnd) & 1) * half_bytes + offset
    return tl.where(peer < 0, offset, in_workspace)


@triton.jit
def _copy_range(
    dst, src, nbytes, COPY_ELEM: tl.constexpr, COPY_BYTES: tl.constexpr, ALIGNED: tl.constexpr, LANES: tl.constexpr
):
    n = nbytes // COPY_BYTES
    d = as_pointer(dst, COPY_ELEM, ALIGNED)
    s = as_pointer(src, COPY_ELEM, ALIGNED)
    body = _vector_body(n, COPY_BYTES, ALIGNED)
    # Each thread loads _COPY_VECTORS 16-byte vectors, all in flight at once, before it stores any.
    # src may be a peer's: .cg, as every peer load (docs/kernel-contract.md, "One memory contract").
    STEP: tl.constexpr = _COPY_VECTORS * 16 * LANES // COPY_BYTES
    for start in range(0, body, STEP):
        offs = start + tl.arange(0, STEP)
        mask = offs < body
        tl.store(d + offs, tl.load(s + offs, mask=mask, cache_modifier=".cg"), mask=mask)
    # The last elements that do not fill a 16-byte vector (none unless ALIGNED).
    offs = body + tl.arange(0, 16)
    mask = offs < n
    tl.store(d + offs, tl.load(s + offs, mask=mask, cache_modifier=".cg"), mask=mask)


@triton.jit
def _vector_body(n, ELEM_BYTES: tl.constexpr, ALIGNED: tl.constexpr):
    """How many of n elements fill whole 16-byte vectors, marked as such so that masked loads
    and stores over them compile to vector instructions; all n unless ALIGNED."""
    if ALIGNED:
        VEC: tl.constexpr = 16 // ELEM_BYTES
        return tl.multiple_of(n // VEC * VEC, VEC)
    else:
        return n


@triton.jit
def _reduce_range(
    out,
    out2,
    store_also,
    opnd_ptr,
    first_src,
    n_src,
    lo,
    nbytes,
    peers_ptr,
    e0,
    half_bytes,
    do_divide,
    divisor,
    cursor,
    quota,
    total,
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
    DTYPE: tl.constexpr,
    OP: tl.constexpr,
    ELEM_BYTES: tl.constexpr,
    ALIGNED: tl.constexpr,
    SOURCES: tl.constexpr,
    LANES: tl.constexpr,
    COPY_ELEM: tl.constexpr,
    COPY_BYTES: tl.constexpr,
):
    """The granule [lo, lo + nbytes) of a REDUCE; every step also copies the next ``quota`` of the
    ``total`` carried bytes this channel owns, from ``cursor`` (kernels/triton/carry.py). Returns
    the cursor after them."""
    n = nbytes // ELEM_BYTES
    body = _vector_body(n, ELEM_BYTES, ALIGNED)
    # Each thread loads VECTORS 16-byte vectors of each of SOURCES sources before folding any:
    # about _REDUCE_LOADS loads in flight per thread, two per source at least.
    VECTORS: tl.constexpr = max(2, _REDUCE_LOADS // SOURCES)
    STEP: tl.constexpr = VECTORS * 16 * LANES // ELEM_BYTES
    for start in range(0, body, STEP):
        offs = start + tl.arange(0, STEP)
        cursor = _reduce_step(
            out,
            out2,
            store_also,
            opnd_ptr,
            first_src,
            n_src,
            lo,
            offs,
            offs < body,
            peers_ptr,
            e0,
            half_bytes,
            do_divide,
            divisor,
            cursor,
            quota,
            total,
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
            DTYPE,
            OP,
            ALIGNED,
            SOURCES,
            LANES,
            COPY_ELEM,
            COPY_BYTES,
        )
    offs = body + tl.arange(0, 16)
    cursor = _reduce_step(
        out,
        out2,
        store_also,
        opnd_ptr,
        first_src,
        n_src,
        lo,
        offs,
        offs < n,
        peers_ptr,
        e0,
        half_bytes,
        do_divide,
        divisor,
        cursor,
        quota,
        total,
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
        DTYPE,
        OP,
        ALIGNED,
        SOURCES,
        LANES,
        COPY_ELEM,
        COPY_BYTES,
    )
    return cursor


@triton.jit
def _load_sources(
    opnd_ptr,
    first,
    count,
    lo,
    offs,
    mask,
    peers_ptr,
    e0,
    half_bytes,
    DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    SOURCES: tl.constexpr,
):
    """Sources first .. first + SOURCES - 1 of a REDUCE (those below ``count`` of them), loaded at
    once in the accumulation type: their loads are independent, so all of them are in flight
    together. A slot at or past ``count`` loads nothing (its mask is off)."""
    xs = ()
    for j in tl.static_range(SOURCES):
        # A slot past the last source names the last one (a valid operand) and masks every lane.
        src = _address(opnd_ptr, first + tl.minimum(j, count - 1), peers_ptr, e0, half_bytes) + lo
        live = mask & (tl.full(offs.shape, j, tl.int64) < count)
        xs = xs + (load_acc(src, offs, live, DTYPE, ALIGNED),)
    return xs


@triton.jit
def _fold(acc, xs, count, OP: tl.constexpr, SOURCES: tl.constexpr, FIRST: tl.constexpr):
    """Fold the first ``count`` of ``xs`` into ``acc`` in order, from ``xs[FIRST]``."""
    for j in tl.static_range(FIRST, SOURCES):
        acc = tl.where(j < count, combine(acc, xs[j], OP), acc)
    return acc


@triton.jit
def _reduce_step(
    out,
    out2,
    store_also,
    opnd_ptr,
    first_src,
    n_src,
    lo,
    offs,
    mask,
    peers_ptr,
    e0,
    half_bytes,
    do_divide,
    divisor,
    cursor,
    quota,
    total,
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
    DTYPE: tl.constexpr,
    OP: tl.constexpr,
    ALIGNED: tl.constexpr,
    SOURCES: tl.constexpr,
    LANES: tl.constexpr,
    COPY_ELEM: tl.constexpr,
    COPY_BYTES: tl.constexpr,
):
    # Sources fold in rank order, SOURCES at a time (one group for every algorithm up to 8 ranks),
    # so the bits are those of a fold one source after the other.
    xs = _load_sources(opnd_ptr, first_src, n_src, lo, offs, mask, peers_ptr, e0, half_bytes, DTYPE, ALIGNED, SOURCES)
    # The carried copies' share of this step, while the fold's loads are in flight (the fold below
    # waits for them; nothing of the copies' bytes is a source or destination of the fold).
    cursor = carry_share(
        cursor,
        tl.minimum(quota, total - cursor),
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
        COPY_ELEM,
        COPY_BYTES,
        ALIGNED,
        LANES,
    )
    acc = _fold(xs[0], xs, n_src, OP, SOURCES, 1)
    for group in range(SOURCES, n_src, SOURCES):
        xs = _load_sources(
            opnd_ptr,
            first_src + group,
            n_src - group,
            lo,
            offs,
            mask,
            peers_ptr,
            e0,
            half_bytes,
            DTYPE,
            ALIGNED,
            SOURCES,
        )
        acc = _fold(acc, xs, n_src - group, OP, SOURCES, 0)
    if do_divide != 0:
        acc = divide(acc, divisor.to(acc.dtype))
    # Every source of these elements is read before they are stored: out (and out2) may alias one.
    store_rounded(out + lo, offs, acc, mask, DTYPE, ALIGNED)
    if store_also != 0:  # the second destination: the same rounded values, from the same lanes
        store_rounded(out2 + lo, offs, acc, mask, DTYPE, ALIGNED)
    return cursor


@triton.jit
def _move(
    row,
    n_carried,
    opnd_ptr,
    peers_ptr,
    e0,
    half_bytes,
    granule,
    channel,
    channels,
    DTYPE: tl.constexpr,
    OP: tl.constexpr,
    COPY_ELEM: tl.constexpr,
    COPY_BYTES: tl.constexpr,
    ELEM_BYTES: tl.constexpr,
    ALIGNED: tl.constexpr,
    SOURCES: tl.constexpr,
    LANES: tl.constexpr,
):
    """One COPY or REDUCE, on the granules of [pos, pos + nbytes) this channel owns; a REDUCE
    with the ``n_carried`` COPYs after it (kernels/triton/carry.py)."""
    # The previous instruction may have written bytes this one reads, from other threads of the
    # channel (a REDUCE moves DTYPE elements, a COPY wider units: the threads do not line up).
    tl.debug_barrier()
    opcode = tl.load(row)
    nbytes = tl.load(row + 1)
    pos = tl.load(row + 2)
    n_src = tl.load(row + 3)
    first = tl.load(row + 4)
    do_divide = tl.load(row + 5)
    divisor = tl.load(row + 6)
    # A REDUCE's second destination follows its sources (a valid operand either way: its output
    # stands in where there is none, and nothing is stored there).
    store_also = (tl.load(row + 7) & _STORE_ALSO) * (opcode != _COPY).to(tl.int64)
    dst = _address(opnd_ptr, first, peers_ptr, e0, half_bytes)
    also = _address(opnd_ptr, tl.where(store_also != 0, first + 1 + n_src, first), peers_ptr, e0, half_bytes)
    # The carried COPYs (the rows after a REDUCE flagged CARRIED; the main loop skips them). Without
    # one, its row stands for the REDUCE's with no bytes: valid addresses, nothing moved.
    row1 = row + _WORDS * tl.minimum(n_carried, 1)
    row2 = row + _WORDS * n_carried
    n1 = tl.load(row1 + 1) * (n_carried >= 1).to(tl.int64)
    n2 = tl.load(row2 + 1) * (n_carried >= 2).to(tl.int64)
    pos1 = tl.load(row1 + 2)
    pos2 = tl.load(row2 + 2)
    dst1 = _address(opnd_ptr, tl.load(row1 + 4), peers_ptr, e0, half_bytes)
    src1 = _address(opnd_ptr, tl.load(row1 + 4) + 1, peers_ptr, e0, half_bytes)
    dst2 = _address(opnd_ptr, tl.load(row2 + 4), peers_ptr, e0, half_bytes)
    src2 = _address(opnd_ptr, tl.load(row2 + 4) + 1, peers_ptr, e0, half_bytes)
    # Spread them over the fold's steps (about one step per RSTEP bytes of the fold's own granules):
    # a share in each, not all of them after the last.
    RSTEP: tl.constexpr = max(2, _REDUCE_LOADS // SOURCES) * 16 * LANES
    fold = owned_bytes(pos, nbytes, granule, channel, channels)
    owned1, start2, total, quota = carry_plan(
        pos1, n1, pos2, n2, fold, RSTEP, granule, channel, channels, COPY_BYTES, ALIGNED
    )
    cursor = total * 0
    end = pos + nbytes
    g_first = pos // granule
    g = g_first + (channel - g_first % channels + channels) % channels
    while g * granule < end:
        lo = tl.maximum(g * granule, pos) - pos
        hi = tl.minimum((g + 1) * granule, end) - pos
        if opcode == _COPY:
            src = _address(opnd_ptr, first + 1, peers_ptr, e0, half_bytes)
            _copy_range(dst + lo, src + lo, hi - lo, COPY_ELEM, COPY_BYTES, ALIGNED, LANES)
        else:
            cursor = _reduce_range(
                dst,
                also,
                store_also,
                opnd_ptr,
                first + 1,
                n_src,
                lo,
                hi - lo,
                peers_ptr,
                e0,
                half_bytes,
                do_divide,
                divisor,
                cursor,
                quota,
                total,
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
                DTYPE,
                OP,
                ELEM_BYTES,
                ALIGNED,
                SOURCES,
                LANES,
                COPY_ELEM,
                COPY_BYTES,
            )
        g += channels
    # What the fold's steps left of the carried copies (all of them where this channel owns no byte
    # of the REDUCE).
    carry_share(
        cursor,
        total - cursor,
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
        COPY_ELEM,
        COPY_BYTES,
        ALIGNED,
        LANES,
    )


@triton.jit
def _wait_status(seen, target, start, timeout_ns, lanes):
    """The block's one verdict on a wait: 1 while some awaited rank is behind and no thread's
    deadline has passed, otherwise 0 or more (stop waiting).

    Each lane is one thread's (LANES threads): its clock and its flag. The verdict is a reduction
    over all of them, so every warp of the block gets the same value and leaves the wait loop at
    the same iteration, as ``__syncthreads_or`` makes the CUDA kernel's threads do.
    """
    # seen - target < 0: the peer is behind (a difference, so that the test survives wraparound).
    behind = ((seen - target) < 0).to(tl.int32)
    expired = ((clock_ns_lanes(lanes) - start) > timeout_ns).to(tl.int32)
    return tl.max(behind | (expired << 1), axis=0)


@triton.jit
def _sync(
    row,
    e,
    peers_ptr,
    channel,
    rank,
    world,
    fingerprint,
    timeout_ns,
    ident_word,
    all_channels,
    ident0,
    ident1,
    LANES: tl.constexpr,
):
    """One SYNC of this channel: (new epoch, error kind, peers at fault as a mask, a value seen).
    ``ident_word``: the first identity slot of the flag area (int64 words); ``ident0``,
    ``ident1``: the call's identity words."""
    signal_mask = tl.load(row + 1)
    wait_mask = tl.load(row + 2)
    e = e + 1
    lanes = tl.arange(0, LANES)
    if tl.load(row + 3) != 0:
        # The data this SYNC announces was written by this rank's earlier kernels (a symmetric
        # tensor read in place), not by this block: the release below orders only what the block
        # did, so the fence first makes those writes visible at system scope (the signal kernel's
        # reason, docs/kernel-contract.md). The other SYNCs announce the block's own stores.
        fence_sys(lanes)
    # Lane p (thread p of the block) signals rank p and polls rank p's flag. One lane per thread:
    # a tensor smaller than the block would be replicated across warps, each replica doing its
    # own atomics and reaching its own verdict.
    member = lanes < world
    bits = tl.where(member, tl.full((LANES,), 1, tl.int64) << tl.minimum(lanes, 63).to(tl.int64), 0)
    flag_areas = tl.load(peers_ptr + world + lanes, mask=member, other=0)
    my_area = tl.load(peers_ptr + world + rank)
    at_peers = (flag_areas + (channel * world + rank) * 8).to(tl.pointer_type(tl.int64))
    mine = (my_area + (channel * world + lanes) * 8).to(tl.pointer_type(tl.int64))
    # Identity slot (e's parity, channel, writer) of IDENT_WORDS words: this rank's in rank p's
    # area, rank p's in mine (gpucomm.workspace.layout.FlagLayout.identity_slot).
    slots = ident_word * 8 + ((e % 2) * all_channels + channel) * world * 16
    ids_at_peers = (flag_areas + slots + rank * 16).to(tl.pointer_type(tl.int64))
    ids_mine = (my_area + slots + lanes * 16).to(tl.pointer_type(tl.int64))
    signalled = member & ((signal_mask & bits) != 0)
    awaited = member & ((wait_mask & bits) != 0)
    kind, culprits, seen = meet(
        at_peers,
        mine,
        signalled,
        awaited,
        bits,
        e,
        fingerprint,
        timeout_ns,
        ids_at_peers,
        ids_mine,
        ident0,
        ident1,
        LANES,
    )
    return e, kind, culprits, seen


@triton.jit
def meet(
    at_peers,
    mine,
    signalled,
    awaited,
    bits,
    e,
    fingerprint,
    timeout_ns,
    ids_at_peers,
    ids_mine,
    ident0,
    ident1,
    LANES: tl.constexpr,
):
    """The flags of a SYNC at epoch ``e``, lane p for rank p (the program kernel's SYNC, and the
    small kernel's, which signals and awaits every rank): once every thread of the channel has
    stored its data, store the call's identity words ``ident0``, ``ident1`` tagged with ``e``
    at ``ids_at_peers`` (this rank's identity slot of e's parity at rank p) and release
    ``e << FP_BITS | fingerprint`` at ``at_peers`` (the lanes in ``signalled``: rank p's flag
    of this rank), then acquire-poll ``mine`` (the lanes in ``awaited``: this rank's flag of
    rank p) until each reaches epoch ``e`` or the deadline passes, and load the identity words
    rank p stored at ``ids_mine``. ``bits`` is lane p's rank bit. Returns the block's (error
    kind, culprits as a rank mask, the first culprit's value seen): kind 0, MISMATCH (a flag at
    epoch ``e`` with another fingerprint, or identity words tagged ``e`` that are not this
    call's: gpucomm/ops/program.py, "Identity") or TIMEOUT."""
    target = e << _FP_BITS
    lanes = tl.arange(0, LANES)
    value = tl.zeros((LANES,), tl.int64) + (target | fingerprint)  # also what a lane not awaited reads as
    tag = (e & _IDENT_TAG_MASK) << _IDENT_BITS
    word0 = tl.zeros((LANES,), tl.int64) + (tag | ident0)
    word1 = tl.zeros((LANES,), tl.int64) + (tag | ident1)
    # A launch without an identity (words 0: tables made by hand) neither stores nor compares any.
    identified = (tl.zeros((LANES,), tl.int64) + ident0) != 0
    # The identity words go out before the flag: the flag's release below publishes them.
    tl.store(ids_at_peers, word0, mask=signalled & identified)
    tl.store(ids_at_peers + 1, word1, mask=signalled & identified)
    # Every thread of the channel has stored its data before the flag is released.
    tl.debug_barrier()
    # Release at system scope: a peer (another GPU, or the host) that acquires the new value sees
    # everything this channel wrote before.
    tl.atomic_xchg(at_peers, value, mask=signalled, sem="release", scope="sys")
    zero = tl.zeros((LANES,), tl.int64)
    # An atomic add of 0 is an acquire load every GPU and the interpreter support.
    seen = tl.where(awaited, tl.atomic_add(mine, zero, mask=awaited, sem="acquire", scope="sys"), value)
    start = clock_ns_lanes(lanes)
    status = _wait_status(seen, target, start, timeout_ns, lanes)
    while status == 1:
        seen = tl.where(awaited, tl.atomic_add(mine, zero, mask=awaited, sem="acquire", scope="sys"), value)
        status = _wait_status(seen, target, start, timeout_ns, lanes)
    # Every thread reads peer data only after the acquire above.
    tl.debug_barrier()
    # The outcome from the flags seen, by reductions over every lane: the block's, like the verdict.
    behind = (seen - target) < 0
    # The identity words of the peers that arrived, loaded after the acquire of their flags (as
    # atomics: a peer two epochs on may be rewriting them, and a word is read whole).
    arrived = awaited & (behind == 0) & identified
    seen0 = tl.where(arrived, tl.atomic_add(ids_mine, zero, mask=arrived, sem="acquire", scope="sys"), word0)
    seen1 = tl.where(arrived, tl.atomic_add(ids_mine + 1, zero, mask=arrived, sem="acquire", scope="sys"), word1)
    # Words of this epoch (their tag is e's) that are not this call's; a word with a later tag
    # was rewritten by a peer that compared this rank's words already (gpucomm/ops/program.py).
    current = (((seen0 ^ word0) >> _IDENT_BITS) == 0) & (((seen1 ^ word1) >> _IDENT_BITS) == 0)
    other_ident = current & ((seen0 != word0) | (seen1 != word1))
    other_call = (((seen >> _FP_BITS) == e) & ((seen & _FP_MASK) != fingerprint)) | other_ident
    behind_mask = tl.sum(tl.where(behind, bits, 0), axis=0)
    other_mask = tl.sum(tl.where(other_call, bits, 0), axis=0)
    kind = tl.where(other_mask != 0, _MISMATCH, tl.where(behind_mask != 0, _TIMEOUT, 0))
    culprits = tl.where(other_mask != 0, other_mask, behind_mask)
    first = tl.min(tl.where((culprits & bits) != 0, lanes, LANES), axis=0)
    seen_first = tl.sum(tl.where(lanes == first, seen, 0), axis=0)
    return kind, culprits, seen_first


@triton.jit
def _record(record_addr, state, channel, kind, e, instruction, culprits, seen, fingerprint):
    """Write this channel's error record, then poison the communicator's later launches."""
    rec = (record_addr + channel * _RECORD_WORDS * 8).to(tl.pointer_type(tl.int64))
    tl.store(rec + 1, e)
    tl.store(rec + 2, instruction)
    tl.store(rec + 3, culprits)
    tl.store(rec + 4, seen)
    tl.store(rec + 5, fingerprint.to(tl.int64))
    # The kind last, with release: whoever sees it sees the fields.
    tl.atomic_xchg(rec, kind.to(tl.int64), sem="release", scope="sys")
    tl.atomic_xchg(state, tl.full((), 1, tl.int64), sem="release", scope="sys")


@triton.jit(
    do_not_specialize=[
        "n_instr",
        "state_addr",
        "record_addr",
        "rank",
        "world",
        "fingerprint",
        "half_bytes",
        "granule",
        "timeout_ns",
        "all_channels",
        "ident_word",
        "ident0",
        "ident1",
    ]
)
def program_kernel(
    prog_ptr,  # int64[n_instr * WORDS]: the instructions
    n_instr,  # how many
    opnd_ptr,  # int64[OPERAND_WORDS * operands]: the operands the instructions name
    peers_ptr,  # int64[2 * world]: each rank's half 0 address, then each rank's flag area address
    state_addr,  # this rank's state words: [poison, epoch of channel 0, epoch of channel 1, ...]
    record_addr,  # this rank's error records, RECORD_WORDS int64 per channel
    rank,  # this rank, in the workspace
    world,  # ranks of the workspace (<= 63, < LANES)
    fingerprint,  # of the call: every flag carries it (< 2**FP_BITS)
    half_bytes,  # bytes from half 0 to half 1
    granule,  # bytes of in-half positions a channel owns in turn
    timeout_ns,  # a wait gives up after this long
    all_channels,  # channels of the flag layout (epochs in the state words), >= this launch's grid
    ident_word,  # the flag area's first identity slot (int64 words): the words stored beside each flag
    ident0,  # the call's identity words (gpucomm.ops.program.identity): < 2**IDENT_BITS
    ident1,
    DTYPE: tl.constexpr,  # element type of REDUCE
    OP: tl.constexpr,  # gpucomm.ReduceOp value of REDUCE's fold (SUM for AVG: the division is per instruction)
    COPY_ELEM: tl.constexpr,  # the integer type COPY moves
    COPY_BYTES: tl.constexpr,  # its size, which divides every COPY's size, position and addresses
    ELEM_BYTES: tl.constexpr,  # size of DTYPE
    ALIGNED: tl.constexpr,  # every address, position and the granule are multiples of 16 bytes
    SOURCES: tl.constexpr,  # sources a REDUCE loads at once, a power of two (more fold in groups)
    LANES: tl.constexpr,  # threads of a channel, 32 * num_warps: lane p of a SYNC is thread p's
):
    channel = tl.program_id(0)
    channels = tl.num_programs(0)
    state = state_addr.to(tl.pointer_type(tl.int64))
    e0 = tl.load(state + 1 + channel)
    e = e0
    lanes = tl.arange(0, LANES)
    # The poison, as the block sees it: another channel may set it while this one starts, and
    # every thread must take the same path, so one reduction over every thread's look decides.
    running = tl.max(tl.load(state + lanes * 0), axis=0) == 0
    i = 0
    while running & (i < n_instr):
        row = prog_ptr + i * _WORDS
        if tl.load(row) == _SYNC:
            e, kind, culprits, seen = _sync(
                row,
                e,
                peers_ptr,
                channel,
                rank,
                world,
                fingerprint,
                timeout_ns,
                ident_word,
                all_channels,
                ident0,
                ident1,
                LANES,
            )
            if kind != 0:
                _record(record_addr, state, channel, kind, e, i, culprits, seen, fingerprint)
            running = kind == 0
        else:
            # A REDUCE carries the COPYs flagged CARRIED right after it (up to two): it runs them.
            nxt = prog_ptr + tl.minimum(i + 1, n_instr - 1) * _WORDS
            nxt2 = prog_ptr + tl.minimum(i + 2, n_instr - 1) * _WORDS
            c1 = (tl.load(row) == _REDUCE) & (i + 1 < n_instr) & (tl.load(nxt) == _COPY)
            c1 = c1 & ((tl.load(nxt + 7) & _CARRIED) != 0)
            c2 = c1 & (i + 2 < n_instr) & (tl.load(nxt2) == _COPY) & ((tl.load(nxt2 + 7) & _CARRIED) != 0)
            n_carried = c1.to(tl.int32) + c2.to(tl.int32)
            _move(
                row,
                n_carried,
                opnd_ptr,
                peers_ptr,
                e0,
                half_bytes,
                granule,
                channel,
                channels,
                DTYPE,
                OP,
                COPY_ELEM,
                COPY_BYTES,
                ELEM_BYTES,
                ALIGNED,
                SOURCES,
                LANES,
            )
            i += n_carried
        i += 1
    # A launch may run fewer channels than the flag layout has (small messages run one): channel
    # c also keeps the epochs of channels c + grid, c + 2 * grid, ..., so that every channel
    # counts every SYNC and any later launch, whatever its grid, starts from one epoch.
    c = channel
    while c < all_channels:
        tl.store(state + 1 + c, e)
        c += channels


def launch(args: ProgramArgs) -> None:
    """Launch ``program_kernel`` as ``args`` describe (:func:`prepare`)."""
    prepare(args)()


def prepare(args: ProgramArgs, num_warps: int = NUM_WARPS) -> Callable[[], None]:
    """``program_kernel`` as ``args`` describe, through Triton's own dispatch (the interpreter on
    CPU), with every argument packed once: calling the result launches it, building nothing (a
    repeated call of the same program on the same buffers)."""
    grid, values, constexprs, options = arguments(args, num_warps)
    return functools.partial(program_kernel[grid], *values, **constexprs, **options)


def arguments(args: ProgramArgs, num_warps: int = NUM_WARPS) -> tuple[tuple[int], tuple, dict, dict]:
    """The launch of ``program_kernel`` that ``args`` describe (see the module docstring): (grid,
    the kernel's arguments in order, its constexprs, the compile options)."""
    # No REDUCE: any type compiles; one keeps the variants few.
    dtype = torch.int32 if args.dtype is None else args.dtype
    constexprs = {
        "DTYPE": TL_DTYPES[dtype],
        "OP": args.op,
        "COPY_ELEM": COPY_ELEMS[args.copy_bytes],
        "COPY_BYTES": args.copy_bytes,
        "ELEM_BYTES": dtype.itemsize,
        "ALIGNED": args.aligned,
        "SOURCES": sources(args.world),
        "LANES": 32 * num_warps,
    }
    options = {"num_warps": num_warps, "maxnreg": MAX_REGISTERS}
    return (args.channels,), args.kernel_values(), constexprs, options


def sources(world: int) -> int:
    """How many sources a REDUCE of a ``world``-rank workspace loads at once: every algorithm's
    REDUCE has at most ``world`` sources, and up to 8 keep their loads within the registers. A
    power of two, so that a step's elements (a tl.arange) are one too."""
    return min(triton.next_power_of_2(world), MAX_SOURCES)
