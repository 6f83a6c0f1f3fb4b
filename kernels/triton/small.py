"""The small-message all_reduce: a one-shot whose addresses and sizes are its parameters.

The program kernel reads its work from tables: the instruction row, then the operand it names,
then the peer's base address from the peer table, three global loads in series before the first
byte of a peer moves. For a message of a few KiB those round trips are most of the call. Here
every address is a kernel parameter (each rank's half 0 and flag area, at most ``MAX_WORLD``
of each): the only global load a peer address depends on is this channel's epoch, whose parity
picks the half (tests/ops/test_small_ptx.py counts it in the sm_90 PTX).

Per channel c (program c of the grid): copy this channel's share of the tensor into this rank's
half ``e0 % 2`` at the same position; SYNC (the call's identity words beside each flag, then
release ``(e0 + 1) << FP_BITS | fingerprint`` into channel c's flag at every rank, acquire-wait
for every rank's and compare the words beside it: program.py's ``meet``); fold every rank's staged share
in rank order, in the accumulation type, divide once for AVG, round once, and write the result
over the tensor. That is the program kernel's one-shot of one piece (COPY, SYNC, REDUCE) on the
same halves, flags, epochs, records and poison (kernels/triton/program.py's docstring), so its
bits are the program kernel's and the two kinds of launch interleave freely on one workspace.
A launch of fewer channels than the flag layout keeps the epochs of the others in step, as the
program kernel does.

Memory order is the program kernel's (docs/kernel-contract.md, "One memory contract"): data loads
are ``.cg`` (L2 only), the copy-in's as the program kernel's COPY and the fold's through
``load_acc``; the SYNC is a block barrier, then the release stores; the acquire polls, then a
block barrier. No system-scope fence: the flags announce this block's own copy-in, which the
barrier and the cumulative release order, not data written by earlier kernels.
"""

import functools
from collections.abc import Callable

import triton
import triton.language as tl

from gpucomm._kernels.triton._common import OP_AVG, as_pointer, combine, divide, load_acc, store_rounded
from gpucomm._kernels.triton.program import _record, meet
from gpucomm._kernels.triton.types import COPY_ELEMS, TL_DTYPES
from gpucomm.ops.instruction_set import SMALL_SYNC_INSTRUCTION
from gpucomm.ops.launch_args import MAX_SMALL_WORLD, SmallArgs

__all__ = ["small_kernel", "arguments", "prepare", "MAX_WORLD", "NUM_WARPS", "SYNC_INSTRUCTION"]

# Ranks the kernel serves: one parameter per rank's half and flag area.
MAX_WORLD = MAX_SMALL_WORLD
# One block of 4 warps per channel: a step moves 128 16-byte vectors.
NUM_WARPS = 4
# The instruction an error record names: the SYNC of the equivalent program (COPY, SYNC, REDUCE).
SYNC_INSTRUCTION = SMALL_SYNC_INSTRUCTION

_SYNC_INSTRUCTION = tl.constexpr(SYNC_INSTRUCTION)


@triton.jit
def _meet(
    areas,
    my_area,
    e,
    channel,
    rank,
    fingerprint,
    timeout_ns,
    ident_word,
    all_channels,
    ident0,
    ident1,
    WORLD: tl.constexpr,
    LANES: tl.constexpr,
):
    """The SYNC of this channel at epoch ``e``: the program kernel's (``meet``) with every rank in
    both masks, the call's identity words beside the flags. Lane p is thread p, which signals
    rank p (at ``areas[p]``) and polls rank p's flag in ``my_area``. (error kind, culprits as a
    mask, a value seen)."""
    lanes = tl.arange(0, LANES)
    member = lanes < WORLD
    bits = tl.where(member, tl.full((LANES,), 1, tl.int64) << tl.minimum(lanes, 63).to(tl.int64), 0)
    at_peers = (areas + (channel * WORLD + rank) * 8).to(tl.pointer_type(tl.int64))
    mine = (my_area + (channel * WORLD + lanes) * 8).to(tl.pointer_type(tl.int64))
    # Identity slot (e's parity, channel, writer), as the program kernel's _sync.
    slots = ident_word * 8 + ((e % 2) * all_channels + channel) * WORLD * 16
    ids_at_peers = (areas + slots + rank * 16).to(tl.pointer_type(tl.int64))
    ids_mine = (my_area + slots + lanes * 16).to(tl.pointer_type(tl.int64))
    return meet(
        at_peers, mine, member, member, bits, e, fingerprint, timeout_ns, ids_at_peers, ids_mine, ident0, ident1, LANES
    )


@triton.jit
def _fold(
    stages,
    half,
    out,
    offs,
    mask,
    divisor,
    DTYPE: tl.constexpr,
    OP: tl.constexpr,
    ALIGNED: tl.constexpr,
    WORLD: tl.constexpr,
):
    """Elements ``offs`` of every rank's half folded in rank order (from rank 0, whichever rank
    this is), divided once for AVG, rounded once into ``out`` (an address). Every rank's loads
    are issued before the first fold."""
    xs = ()
    for p in tl.static_range(WORLD):
        xs = xs + (load_acc(stages[p] + half, offs, mask, DTYPE, True),)
    acc = xs[0]
    for p in tl.static_range(1, WORLD):
        acc = combine(acc, xs[p], OP)
    if OP == OP_AVG:
        acc = divide(acc, divisor)
    store_rounded(out, offs, acc, mask, DTYPE, ALIGNED)


@triton.jit(
    do_not_specialize=[
        "n",
        "rank",
        "fingerprint",
        "timeout_ns",
        "all_channels",
        "divisor",
        "ident_word",
        "ident0",
        "ident1",
    ]
)
def small_kernel(
    x_addr,  # the tensor's address (an int), reduced in place
    n,  # its elements (at most a half's worth)
    stage0,
    stage1,
    stage2,
    stage3,
    stage4,
    stage5,
    stage6,
    stage7,  # rank p's half 0, in this process (0 past WORLD)
    flags0,
    flags1,
    flags2,
    flags3,
    flags4,
    flags5,
    flags6,
    flags7,  # rank p's flag area, in this process
    half_bytes,  # bytes from half 0 to half 1
    state_addr,  # this rank's state words: [poison, epoch of channel 0, epoch of channel 1, ...]
    record_addr,  # this rank's error records, RECORD_WORDS int64 per channel
    rank,  # this rank, in the workspace
    fingerprint,  # of the call: every flag carries it (< 2**FP_BITS)
    timeout_ns,  # a wait gives up after this long
    all_channels,  # channels of the flag layout (epochs in the state words), >= this launch's grid
    divisor,  # AVG divides the fold by this once
    ident_word,  # the flag area's first identity slot (int64 words): the words stored beside each flag
    ident0,  # the call's identity words (gpucomm.ops.program.identity): < 2**IDENT_BITS
    ident1,
    DTYPE: tl.constexpr,  # element type
    OP: tl.constexpr,  # gpucomm.ReduceOp value (AVG folds as SUM, then divides)
    COPY: tl.constexpr,  # the integer type of DTYPE's size: the copy-in moves bits
    ELEM: tl.constexpr,  # bytes of DTYPE
    ALIGNED: tl.constexpr,  # x_addr is 16-byte aligned (the halves always are)
    WORLD: tl.constexpr,  # ranks of the workspace (<= MAX_WORLD)
    BLOCK: tl.constexpr,  # elements per step
    LANES: tl.constexpr,  # threads of a block: 32 * num_warps
):
    ch = tl.program_id(0)
    channels = tl.num_programs(0)
    lanes = tl.arange(0, LANES)
    state = state_addr.to(tl.pointer_type(tl.int64))
    # The one global load every peer address depends on: its parity picks the half.
    e0 = tl.load(state + 1 + ch)
    # The poison, as the block sees it (one reduction: every thread takes the same path).
    running = tl.max(tl.load(state + lanes * 0), axis=0) == 0
    e = e0
    if running:
        stages = (stage0, stage1, stage2, stage3, stage4, stage5, stage6, stage7)
        areas_of = (flags0, flags1, flags2, flags3, flags4, flags5, flags6, flags7)
        # Rank p's flag area in lane p, this rank's own: selects among parameters, no table.
        areas = tl.zeros((LANES,), tl.int64) + flags0
        mine = stage0
        my_area = flags0
        for p in tl.static_range(1, WORLD):
            areas = tl.where(lanes == p, areas_of[p], areas)
            mine = tl.where(rank == p, stages[p], mine)
            my_area = tl.where(rank == p, areas_of[p], my_area)
        VEC: tl.constexpr = BLOCK // LANES
        # [lo, hi): this channel's share, whole vectors from the tensor's start; body: its whole vectors.
        share = tl.cdiv(tl.cdiv(n, channels), VEC) * VEC
        lo = tl.multiple_of(tl.minimum(ch * share, tl.cdiv(n, VEC) * VEC), VEC)
        hi = tl.minimum(lo + share, n)
        body = tl.multiple_of(tl.maximum(hi // VEC * VEC, lo), VEC)
        half = (e0 & 1) * half_bytes
        staged = tl.multiple_of((mine + half).to(tl.pointer_type(COPY)), 16)
        src = as_pointer(x_addr, COPY, ALIGNED)
        # .cg, as the program kernel's COPY and CUDA's copy_span (docs/kernel-contract.md).
        for s in range(lo, body, BLOCK):
            offs = s + tl.arange(0, BLOCK)
            tl.store(staged + offs, tl.load(src + offs, mask=offs < body, cache_modifier=".cg"), mask=offs < body)
        if body < hi:  # the tensor's last elements, short of a vector
            tail = body + tl.arange(0, VEC)
            tl.store(staged + tail, tl.load(src + tail, mask=tail < hi, cache_modifier=".cg"), mask=tail < hi)
        e = e0 + 1
        kind, culprits, seen = _meet(
            areas, my_area, e, ch, rank, fingerprint, timeout_ns, ident_word, all_channels, ident0, ident1, WORLD, LANES
        )
        if kind != 0:
            _record(record_addr, state, ch, kind, e, _SYNC_INSTRUCTION, culprits, seen, fingerprint)
        else:
            for s in range(lo, body, BLOCK):
                offs = s + tl.arange(0, BLOCK)
                _fold(stages, half, x_addr, offs, offs < body, divisor, DTYPE, OP, ALIGNED, WORLD)
            if body < hi:
                tail = body + tl.arange(0, VEC)
                _fold(stages, half, x_addr, tail, tail < hi, divisor, DTYPE, OP, ALIGNED, WORLD)
    # Channel c also keeps the epochs of channels c + grid, c + 2 * grid, ... (program.py).
    c = ch
    while c < all_channels:
        tl.store(state + 1 + c, e)
        c += channels


def arguments(args: SmallArgs, num_warps: int = NUM_WARPS) -> tuple[tuple[int], tuple, dict, dict]:
    """The launch of :func:`small_kernel` that ``args`` describe (see the module docstring):
    (grid, the kernel's arguments in order, its constexprs, the compile options)."""
    values = (
        args.x,
        args.n,
        *args.padded(args.stages),
        *args.padded(args.flags),
        args.half_bytes,
        args.state_addr,
        args.record_addr,
        args.rank,
        args.fingerprint,
        args.timeout_ns,
        args.all_channels,
        args.divisor,
        args.ident_word,
        *args.identity,
    )
    lanes = 32 * num_warps
    elem_bytes = args.dtype.itemsize
    constexprs = {
        "DTYPE": TL_DTYPES[args.dtype],
        "OP": int(args.op),
        "COPY": COPY_ELEMS[elem_bytes],
        "ELEM": elem_bytes,
        "ALIGNED": args.x % 16 == 0,
        "WORLD": args.world,
        "BLOCK": lanes * (16 // elem_bytes),
        "LANES": lanes,
    }
    return (args.channels,), values, constexprs, {"num_warps": num_warps}


def prepare(args: SmallArgs, num_warps: int = NUM_WARPS) -> Callable[[], None]:
    """``small_kernel`` through Triton's own dispatch (the interpreter on CPU), every argument
    packed once: calling the result launches it."""
    grid, values, constexprs, options = arguments(args, num_warps)
    return functools.partial(small_kernel[grid], *values, **constexprs, **options)
