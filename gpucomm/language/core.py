"""The device API: what a ``@triton.jit`` kernel calls to talk to the other ranks.

Every function takes ``ctx``, the context table a host :class:`gpucomm.language.DeviceContext`
hands the kernel (``ctx.table``; gpucomm.language.layout lists its words). Under
``TRITON_INTERPRET=1`` the same functions run on CPU tensors over the shared-memory workspace.

- where: :func:`rank`, :func:`world`; :func:`translate` a pointer into this rank's copy of a
  symmetric region into ``peer``'s copy; :func:`load` from / :func:`store` to a peer;
  :func:`stage`, this rank's staging buffer for the half of an epoch.
- flags: :func:`signal` one peer's flag, :func:`announce` to every peer, :func:`wait` for one
  rank's flag, :func:`barrier` among all ranks; all with release / acquire at system scope,
  every wait bounded by the context's timeout.
- epochs: :func:`epoch` loads a slot's epoch, :func:`store_epoch` keeps the channels in step.

Waits and the clock. A wait polls until the flag reaches its value (a wraparound-safe
difference) or the deadline passes (``%globaltimer`` on a GPU, the host's clock under the
interpreter: kernels/triton/clock.py). Lanes are threads: a wait or barrier takes ``LANES``
(``32 * num_warps`` of the launch), reads the clock in every thread and decides by a reduction
over all of them, so every warp leaves the loop at the same iteration (the rule of the program
kernel's SYNC, docs/kernel-contract.md). A wait that times out writes the slot's error record
(host-visible memory), sets the context's poison and returns False; a poisoned context's waits
return False at once. The host turns the record into :class:`gpucomm.CommTimeoutError` naming
the ranks that did not arrive (:meth:`DeviceContext.check`).

Ordering. :func:`signal`, :func:`announce` and :func:`barrier` first line up the block's threads
(``tl.debug_barrier``), then release: every store the block made before is visible to a peer
that acquires the value. After a wait succeeds, the block's threads line up again before any of
them reads peer data.
"""

import triton
import triton.language as tl

from gpucomm._kernels.triton.clock import clock_ns_lanes
from gpucomm.language import layout

__all__ = [
    "rank", "world", "translate", "load", "store", "stage", "signal", "announce", "wait", "barrier", "epoch",
    "store_epoch",
]  # fmt: skip

_RANK = tl.constexpr(layout.RANK)
_WORLD = tl.constexpr(layout.WORLD)
_TIMEOUT_NS = tl.constexpr(layout.TIMEOUT_NS)
_RECORD = tl.constexpr(layout.RECORD)
_STATE = tl.constexpr(layout.STATE)
_STAGE = tl.constexpr(layout.STAGE)
_STAGE_HALF = tl.constexpr(layout.STAGE_HALF)
_FLAGS = tl.constexpr(layout.FLAGS)
_REGIONS = tl.constexpr(layout.REGIONS)
_REGION_WORDS = tl.constexpr(layout.REGION_WORDS)
_REGIONS_MAX = tl.constexpr(layout.REGIONS_MAX)
_MAX_WORLD = tl.constexpr(layout.MAX_WORLD)
_CHANNEL_SLOTS = tl.constexpr(layout.CHANNEL_SLOTS)
_RECORD_WORDS = tl.constexpr(layout.RECORD_WORDS)
_TIMEOUT = tl.constexpr(layout.TIMEOUT)


@triton.jit
def rank(ctx):
    """This rank's index in the context (int32)."""
    return tl.load(ctx + _RANK).to(tl.int32)


@triton.jit
def world(ctx):
    """How many ranks the context has (int32)."""
    return tl.load(ctx + _WORLD).to(tl.int32)


@triton.jit
def translate(ptr, peer, ctx):
    """``ptr`` (a pointer, or a block of pointers, into this rank's copy of a symmetric region)
    as the same place in ``peer``'s copy, addressed from this process.

    The distance between two ranks' copies is a multiple of 16 bytes (the host checks it), and
    the result says so: translate a scalar base and add the offsets after
    (``tl.load(gl.translate(x_ptr, peer, ctx) + offs)``), and an aligned base with contiguous
    offsets still loads and stores in 16-byte vectors. A block of pointers translates element by
    element (each may lie in another region), which the compiler cannot vectorise. A pointer
    outside every region is returned unchanged (it stays local).
    """
    me = tl.load(ctx + _RANK)
    addr = ptr.to(tl.int64)
    delta = addr * 0
    for i in tl.static_range(_REGIONS_MAX):
        row = ctx + _REGIONS + i * _REGION_WORDS
        base = tl.load(row + me)
        inside = (addr - base >= 0) & (addr - base < tl.load(row + _MAX_WORLD))
        delta = tl.where(inside, tl.load(row + peer) - base, delta)
    ELEM: tl.constexpr = max(1, ptr.dtype.element_ty.primitive_bitwidth // 8)
    return ptr + tl.multiple_of(delta // ELEM, max(1, 16 // ELEM))


@triton.jit
def load(ptr, peer, ctx, mask=None, other=None):
    """``tl.load`` of ``ptr`` (a pointer or a block of them) translated to ``peer``, ``.cg`` as every
    peer load of gpucomm's kernels (docs/kernel-contract.md). For 16-byte vectors translate the
    scalar base instead (see :func:`translate`)."""
    return tl.load(translate(ptr, peer, ctx), mask=mask, other=other, cache_modifier=".cg")


@triton.jit
def store(ptr, value, peer, ctx, mask=None):
    """``tl.store`` of ``value`` at ``ptr`` (a pointer or a block of them) translated to
    ``peer``. For 16-byte vectors translate the scalar base instead (see :func:`translate`)."""
    tl.store(translate(ptr, peer, ctx), value, mask=mask)


@triton.jit
def stage(ctx, e, T: tl.constexpr):
    """This rank's staging buffer (a pointer to ``T``) for data written at epoch ``e``: half
    ``e % 2`` of the context's stage, 256-byte aligned. Written before a barrier at epoch ``e``
    and read by the peers after it, a half is next written at epoch ``e + 2``, when every rank
    has passed the barrier at ``e + 1`` and so has done reading it (docs/language.md)."""
    addr = tl.load(ctx + _STAGE) + (e & 1) * tl.load(ctx + _STAGE_HALF)
    return tl.multiple_of(addr.to(tl.pointer_type(T)), 16)


@triton.jit
def epoch(ctx, slot):
    """The epoch of ``slot`` that this rank's launches so far have left (int64)."""
    return tl.load(tl.load(ctx + _STATE).to(tl.pointer_type(tl.int64)) + 1 + slot)


@triton.jit
def store_epoch(ctx, e):
    """End a launch that ran :func:`barrier` s on its channels: every channel slot this program
    keeps (its own, and those of programs a smaller grid lacks: ``pid``, ``pid + grid``, ...)
    leaves at epoch ``e``, so that the next launch, whatever its grid, starts every channel at
    one epoch and picks one stage half."""
    state = tl.load(ctx + _STATE).to(tl.pointer_type(tl.int64))
    c = tl.program_id(0)
    while c < _CHANNEL_SLOTS:
        tl.store(state + 1 + c, e)
        c += tl.num_programs(0)


@triton.jit
def _word(ctx, owner, slot, writer):
    """Word ``(slot, writer)`` of ``owner``'s flag bank (scalar or lanes), as an int64 pointer."""
    P = tl.load(ctx + _WORLD)
    return (tl.load(ctx + _FLAGS + owner) + (slot * P + writer) * 8).to(tl.pointer_type(tl.int64))


@triton.jit
def signal(ctx, slot, peer, value):
    """Release ``value`` into word ``(slot, this rank)`` of ``peer``'s bank, after every store
    this block made so far."""
    tl.debug_barrier()
    tl.atomic_xchg(_word(ctx, peer, slot, rank(ctx)), tl.zeros((), tl.int64) + value, sem="release", scope="sys")


@triton.jit
def announce(ctx, slot, value, LANES: tl.constexpr):
    """:func:`signal` ``value`` on ``slot`` to every rank (this one included): lane p signals
    rank p, one thread each."""
    lanes = tl.arange(0, LANES)
    member = lanes < tl.load(ctx + _WORLD)
    at = _word(ctx, tl.where(member, lanes, 0), slot, rank(ctx))
    tl.debug_barrier()
    values = tl.zeros((LANES,), tl.int64) + value
    tl.atomic_xchg(at, values, mask=member, sem="release", scope="sys")


@triton.jit
def _poisoned(ctx, lanes):
    """Whether the context is poisoned, as every thread of the block agrees (one reduction)."""
    state = tl.load(ctx + _STATE).to(tl.pointer_type(tl.int64))
    return tl.max(tl.load(state + lanes * 0), axis=0) != 0


@triton.jit
def _poll(mine, awaited, target):
    """Acquire-load the awaited lanes' flags (an atomic add of 0); the others read as arrived."""
    zero = tl.zeros(awaited.shape, tl.int64)
    return tl.where(awaited, tl.atomic_add(mine, zero, mask=awaited, sem="acquire", scope="sys"), target)


@triton.jit
def _verdict(seen, target, start, timeout_ns, lanes):
    """1 while an awaited flag is behind and no thread's deadline has passed (the block's one
    verdict, a reduction over every thread's look: kernels/triton/program.py's ``_wait_status``)."""
    behind = ((seen - target) < 0).to(tl.int32)
    expired = ((clock_ns_lanes(lanes) - start) > timeout_ns).to(tl.int32)
    return tl.max(behind | (expired << 1), axis=0)


@triton.jit
def _await(ctx, slot, awaited, writers, value, lanes):
    """Poll this rank's words ``(slot, writers[lane])`` of the awaited lanes until each reaches
    ``value`` or the deadline passes; on a timeout write the slot's record and poison the
    context. True when every awaited flag arrived."""
    ok = not _poisoned(ctx, lanes)
    if ok:
        target = tl.zeros(lanes.shape, tl.int64) + value
        mine = _word(ctx, rank(ctx), slot, writers)
        timeout_ns = tl.load(ctx + _TIMEOUT_NS)
        seen = _poll(mine, awaited, target)
        start = clock_ns_lanes(lanes)
        status = _verdict(seen, target, start, timeout_ns, lanes)
        while status == 1:
            seen = _poll(mine, awaited, target)
            status = _verdict(seen, target, start, timeout_ns, lanes)
        # Every thread reads peer data only after the acquire above.
        tl.debug_barrier()
        bits = tl.where(awaited, tl.full(lanes.shape, 1, tl.int64) << tl.minimum(writers, 63).to(tl.int64), 0)
        behind = (seen - target) < 0
        culprits = tl.sum(tl.where(behind, bits, 0), axis=0)
        if culprits != 0:
            first = tl.min(tl.where(behind, lanes, lanes.shape[0]), axis=0)
            seen_first = tl.sum(tl.where(lanes == first, seen, 0), axis=0)
            _record(ctx, slot, value, culprits, seen_first)
        ok = culprits == 0
    return ok


@triton.jit
def _record(ctx, slot, value, culprits, seen):
    """Write ``slot``'s error record (``value`` awaited), then poison the context."""
    rec = (tl.load(ctx + _RECORD) + slot * _RECORD_WORDS * 8).to(tl.pointer_type(tl.int64))
    tl.store(rec + 1, tl.zeros((), tl.int64) + value)
    tl.store(rec + 2, tl.zeros((), tl.int64) + slot)
    tl.store(rec + 3, culprits)
    tl.store(rec + 4, seen)
    tl.store(rec + 5, tl.zeros((), tl.int64))
    # The kind last, with release: whoever sees it sees the fields.
    tl.atomic_xchg(rec, tl.full((), _TIMEOUT, tl.int64), sem="release", scope="sys")
    state = tl.load(ctx + _STATE).to(tl.pointer_type(tl.int64))
    tl.atomic_xchg(state, tl.full((), 1, tl.int64), sem="release", scope="sys")


@triton.jit
def wait(ctx, slot, src, value, LANES: tl.constexpr):
    """Wait until ``src`` has signalled at least ``value`` on ``slot`` (this rank's word
    ``(slot, src)``), acquiring what ``src`` stored before. False if the deadline passed (the
    record names ``src``) or the context was poisoned already."""
    lanes = tl.arange(0, LANES)
    writers = lanes * 0 + src
    return _await(ctx, slot, lanes == 0, writers, value, lanes)


@triton.jit
def barrier(ctx, channel, e, LANES: tl.constexpr):
    """Every rank's program ``channel`` meets here: signal epoch ``e + 1`` on the channel's slot
    to every rank, wait for every rank's. Returns ``(e + 1, ok)``; ``ok`` is False if some rank
    did not arrive before the deadline (the record names them) or the context was poisoned.

    Flags are written only by their owner and never reset: a barrier passes on any later value
    too, so nothing needs resetting between launches (the epoch lives in the state words:
    :func:`epoch`, :func:`store_epoch`)."""
    e = e + 1
    announce(ctx, channel, e, LANES)
    lanes = tl.arange(0, LANES)
    member = lanes < tl.load(ctx + _WORLD)
    ok = _await(ctx, channel, member, tl.where(member, lanes, 0), e, lanes)
    return e, ok
