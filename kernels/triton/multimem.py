"""The multimem all_reduce: NVLink SHARP reduces in the switch (sm_90 and up, NVSwitch).

A symmetric tensor (gpucomm.empty) lives at the same offset of every rank's heap, and the heap is
bound to a multicast object: one more address, ``mc_addr``, at which a load-reduce
(``multimem.ld_reduce``) returns the reduction of every rank's copy, computed in the switch,
and a store (``multimem.st``) writes every rank's copy at once. Rank r reduces slice r of the
tensor that way and stores the result to every rank, so each GPU's link carries about
(1 + 1/P) n bytes instead of two-shot's 2 (P-1)/P n.

One launch, ``channels`` blocks; block b of rank r moves the 16-byte vectors i of slice r with
i % channels == b, between two barriers of block b with block b of every rank:

- the start barrier: every rank's tensor holds its input (release by the signaller, acquire by
  the waiter, at system scope) before any rank reads it through the switch. The input was
  written by this rank's earlier kernels, so a system-scope fence (``membar.sys``) goes before
  the release, as in the signal kernel (docs/kernel-contract.md);
- the end barrier: every rank's stores have landed before any rank returns (the caller may read
  or write its tensor right after).

A barrier is a multicast add: lane 0 of block b adds 1 to word b of the signal pad at its
multicast address (``multimem.red.release``: one instruction increments word b on every rank),
then the block waits until its own rank's word b reaches ``world`` times the number of barriers
block b has passed (kept in this rank's state words: a replayed CUDA graph goes on from there).
Every wait ends by its deadline (``clock_ns_lanes``); a timeout writes the block's error record
(gpucomm.ops.program's layout: kind, barrier count, -, -, value seen) and poisons later launches.

16-bit floats: ``.acc::f32`` makes the switch accumulate in fp32 and round once. Which order the
switch folds the ranks in is not documented: until a GPU shows that it is rank order, this path
is outside gpucomm's deterministic contract for floating-point SUM (docs/algorithms.md).

Under the Triton interpreter (TRITON_INTERPRET=1) there is no switch: the *multicast view* of
the shared-memory heap stands in for it. A load-reduce reads every rank's copy through the table
of heap bases, in rank order, in the accumulation type, and rounds once; a store writes every
rank's copy; the barrier's add goes to every rank's word. The same kernel, with the same
barriers, runs across real processes in CI.
"""

import triton
import triton.language as tl

from gpucomm._kernels.triton._common import OP_MIN, OP_SUM, combine, load_acc, store_rounded
from gpucomm._kernels.triton.clock import INTERPRETED, clock_ns_lanes
from gpucomm._kernels.triton.fence import fence_sys
from gpucomm.ops import instruction_set as isa

__all__ = ["multimem_all_reduce_kernel", "launch", "NUM_WARPS", "SWITCH_REDUCES"]

NUM_WARPS = 4
_TIMEOUT = tl.constexpr(isa.TIMEOUT)
_RECORD_WORDS = tl.constexpr(isa.RECORD_WORDS)
# What the switch reduces, as gpucomm.ReduceOp values per dtype name: floating-point SUM (16-bit
# floats accumulated in fp32: ``.acc::f32``), and integer SUM (wrapping), MIN and MAX.
SWITCH_REDUCES = {
    "float32": (isa.OP_SUM,),
    "float16": (isa.OP_SUM,),
    "bfloat16": (isa.OP_SUM,),
    "int32": (isa.OP_SUM, isa.OP_MIN, isa.OP_MAX),
    "int64": (isa.OP_SUM, isa.OP_MIN, isa.OP_MAX),
}


@triton.jit
def _unit_address(mc_base, offset, units, UNIT_BYTES: tl.constexpr):
    """The multicast address of each unit: 64-bit arithmetic, since Triton types a unit index
    that fits 32 bits as an i32 and a tensor's units past 2 GiB / UNIT_BYTES would wrap."""
    return mc_base + offset + units.to(tl.int64) * UNIT_BYTES


if INTERPRETED:

    @triton.jit
    def _reduce_units(
        mc_base, peers_ptr, offset, units, mask, world, DTYPE: tl.constexpr, OP: tl.constexpr, UNIT_ELEMS: tl.constexpr
    ):
        """The multicast view: fold every rank's copy in rank order in the accumulation type,
        round once, store to every rank's copy."""
        elems = units[:, None] * UNIT_ELEMS + tl.arange(0, UNIT_ELEMS)[None, :]
        live = mask[:, None] & (elems >= 0)
        acc = load_acc(tl.load(peers_ptr) + offset, elems, live, DTYPE, True)
        for p in range(1, world):
            acc = combine(acc, load_acc(tl.load(peers_ptr + p) + offset, elems, live, DTYPE, True), OP)
        for p in range(0, world):
            store_rounded(tl.load(peers_ptr + p) + offset, elems, acc, live, DTYPE, True)

    @triton.jit
    def _signal_all(mc_base, peers_ptr, pad, lanes, world):
        """The multicast add: +1 to word ``pad`` of every rank's heap, from lane 0."""
        for p in range(0, world):
            word = (tl.load(peers_ptr + p) + pad + lanes * 0).to(tl.pointer_type(tl.int64))
            tl.atomic_add(word, tl.full(lanes.shape, 1, tl.int64), mask=lanes == 0, sem="release", scope="sys")

else:

    @triton.jit
    def _reduce_units(
        mc_base, peers_ptr, offset, units, mask, world, DTYPE: tl.constexpr, OP: tl.constexpr, UNIT_ELEMS: tl.constexpr
    ):
        """One unit per lane (a 16-byte vector of floats, one integer), reduced by the switch at
        the multicast address and stored to every rank's copy."""
        if DTYPE == tl.float32:
            _ld_reduce_st_v4(_unit_address(mc_base, offset, units, 16), mask, "add.v4.f32", "v4.f32")
        elif DTYPE == tl.bfloat16:
            _ld_reduce_st_v4(_unit_address(mc_base, offset, units, 16), mask, "add.acc::f32.v4.bf16x2", "v4.bf16x2")
        elif DTYPE == tl.float16:
            _ld_reduce_st_v4(_unit_address(mc_base, offset, units, 16), mask, "add.acc::f32.v4.f16x2", "v4.f16x2")
        elif DTYPE == tl.int32:
            _ld_reduce_st_word(_unit_address(mc_base, offset, units, 4), mask, OP, 32)
        else:
            _ld_reduce_st_word(_unit_address(mc_base, offset, units, 8), mask, OP, 64)

    @triton.jit
    def _ld_reduce_st_v4(addr, mask, LD: tl.constexpr, ST: tl.constexpr):
        # A lane past the slice's end loads and stores nothing: the mask is its predicate.
        a, b, c, d = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0; "
            "@p multimem.ld_reduce.relaxed.sys.global." + LD + " {$0, $1, $2, $3}, [$4]; }",
            "=r,=r,=r,=r,l,r",
            [addr, mask.to(tl.int32)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=False,
            pack=1,
        )
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $6, 0; "
            "@p multimem.st.relaxed.sys.global." + ST + " [$1], {$2, $3, $4, $5}; mov.b32 $0, 0; }",
            "=r,l,r,r,r,r,r",
            [addr, a, b, c, d, mask.to(tl.int32)],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )

    @triton.jit
    def _ld_reduce_st_word(addr, mask, OP: tl.constexpr, BITS: tl.constexpr):
        # Integer SUM wraps (u32/u64 add is the same bits as signed); MIN and MAX are signed.
        if BITS == 32:
            if OP == OP_SUM:
                x = tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; "
                    "@p multimem.ld_reduce.relaxed.sys.global.add.u32 $0, [$1]; }",
                    "=r,l,r",
                    [addr, mask.to(tl.int32)],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
            elif OP == OP_MIN:
                x = tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; "
                    "@p multimem.ld_reduce.relaxed.sys.global.min.s32 $0, [$1]; }",
                    "=r,l,r",
                    [addr, mask.to(tl.int32)],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
            else:
                x = tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b32 $0, 0; "
                    "@p multimem.ld_reduce.relaxed.sys.global.max.s32 $0, [$1]; }",
                    "=r,l,r",
                    [addr, mask.to(tl.int32)],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; "
                "@p multimem.st.relaxed.sys.global.b32 [$1], $2; mov.b32 $0, 0; }",
                "=r,l,r,r",
                [addr, x, mask.to(tl.int32)],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            if OP == OP_SUM:
                x = tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b64 $0, 0; "
                    "@p multimem.ld_reduce.relaxed.sys.global.add.u64 $0, [$1]; }",
                    "=l,l,r",
                    [addr, mask.to(tl.int32)],
                    dtype=tl.int64,
                    is_pure=False,
                    pack=1,
                )
            elif OP == OP_MIN:
                x = tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b64 $0, 0; "
                    "@p multimem.ld_reduce.relaxed.sys.global.min.s64 $0, [$1]; }",
                    "=l,l,r",
                    [addr, mask.to(tl.int32)],
                    dtype=tl.int64,
                    is_pure=False,
                    pack=1,
                )
            else:
                x = tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; mov.b64 $0, 0; "
                    "@p multimem.ld_reduce.relaxed.sys.global.max.s64 $0, [$1]; }",
                    "=l,l,r",
                    [addr, mask.to(tl.int32)],
                    dtype=tl.int64,
                    is_pure=False,
                    pack=1,
                )
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; "
                "@p multimem.st.relaxed.sys.global.b64 [$1], $2; mov.b32 $0, 0; }",
                "=r,l,l,r",
                [addr, x, mask.to(tl.int32)],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )

    @triton.jit
    def _signal_all(mc_base, peers_ptr, pad, lanes, world):
        """``multimem.red.release.sys``: +1 to word ``pad`` of every rank's heap, from lane 0.
        Then ``fence.proxy.alias`` in every thread: the add goes through the multicast address and
        the wait polls the same word through the ordinary one, two aliases of one memory, whose
        accesses the CUDA programming guide orders only across that fence (its multimem barrier
        example puts it between the two, as here)."""
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.eq.b32 p, $2, 0; @p multimem.red.release.sys.global.add.u64 [$1], 1; "
            "fence.proxy.alias; mov.b32 $0, 0; }",
            "=r,l,r",
            [mc_base + pad + lanes.to(tl.int64) * 0, lanes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _barrier(mc_base, peers_ptr, pad, own_word, count, world, timeout_ns, LANES: tl.constexpr, FENCE: tl.constexpr):
    """One barrier of this block with the same block of every rank: (arrived, smallest value seen).
    ``FENCE``: a system-scope fence in every thread first (the start barrier's)."""
    lanes = tl.arange(0, LANES)
    if FENCE:
        # The start barrier announces the tensor's input, written by this rank's earlier kernels,
        # not by this block: the release orders only the block's own accesses, so the fence first
        # makes those writes visible at system scope, as the signal kernel does
        # (docs/kernel-contract.md). The end barrier announces the block's own stores: none.
        fence_sys(lanes)
    # Every thread of the block has stored what it stores before lane 0 releases the signal.
    tl.debug_barrier()
    _signal_all(mc_base, peers_ptr, pad, lanes, world)
    target = count * world
    mine = own_word + lanes * 0
    zero = tl.zeros((LANES,), tl.int64)
    seen = tl.atomic_add(mine, zero, sem="acquire", scope="sys")
    start = clock_ns_lanes(lanes)
    # One block-wide verdict per poll (reductions over every lane), as the program kernel's waits.
    behind = tl.max(((seen - target) < 0).to(tl.int32), axis=0)
    expired = tl.max(((clock_ns_lanes(lanes) - start) > timeout_ns).to(tl.int32), axis=0)
    while (behind == 1) & (expired == 0):
        seen = tl.atomic_add(mine, zero, sem="acquire", scope="sys")
        behind = tl.max(((seen - target) < 0).to(tl.int32), axis=0)
        expired = tl.max(((clock_ns_lanes(lanes) - start) > timeout_ns).to(tl.int32), axis=0)
    # Every thread reads (through the switch) only after the acquire above.
    tl.debug_barrier()
    return behind == 0, tl.min(seen, axis=0)


@triton.jit(
    do_not_specialize=[
        "mc_base",
        "offset",
        "signal_offset",
        "state_addr",
        "record_addr",
        "rank",
        "world",
        "lo",
        "hi",
        "timeout_ns",
    ]
)
def multimem_all_reduce_kernel(
    mc_base,  # the heap's multicast address (GPU; unused under the interpreter)
    peers_ptr,  # int64[world]: every rank's heap base in this process (the interpreter's multicast view)
    offset,  # the tensor's byte offset in the heap
    signal_offset,  # byte offset in the heap of the signal pad: one int64 word per block
    state_addr,  # this rank's state: [poison, barriers passed by block 0, by block 1, ...]
    record_addr,  # error records, RECORD_WORDS int64 per block
    rank,  # this rank on the node
    world,  # ranks of the node
    lo,  # first unit (16-byte vector of floats, or one integer) of this rank's slice
    hi,  # one past its last unit
    timeout_ns,  # a barrier gives up after this long
    DTYPE: tl.constexpr,
    OP: tl.constexpr,  # gpucomm.ReduceOp value: SUM (0), MIN (2), MAX (3)
    UNIT_ELEMS: tl.constexpr,  # elements of DTYPE per unit
    LANES: tl.constexpr,  # threads of a block
):
    block = tl.program_id(0)
    blocks = tl.num_programs(0)
    state = state_addr.to(tl.pointer_type(tl.int64))
    lanes = tl.arange(0, LANES)
    # The poison as the whole block sees it (another block may set it meanwhile).
    running = tl.max(tl.load(state + lanes * 0), axis=0) == 0
    if running:
        count = tl.load(state + 1 + block)
        pad = signal_offset + block * 8
        own_word = (tl.load(peers_ptr + rank) + pad).to(tl.pointer_type(tl.int64))
        ok, seen = _barrier(mc_base, peers_ptr, pad, own_word, count + 1, world, timeout_ns, LANES, True)
        if ok:
            # Units lo .. hi-1 of this rank's slice, LANES at a time, every blocks-th group this block's.
            for start in range(lo + block * LANES, hi, blocks * LANES):
                units = start + lanes
                _reduce_units(mc_base, peers_ptr, offset, units, units < hi, world, DTYPE, OP, UNIT_ELEMS)
            ok, seen = _barrier(mc_base, peers_ptr, pad, own_word, count + 2, world, timeout_ns, LANES, False)
            tl.store(state + 1 + block, count + 2)
        if not ok:
            rec = (record_addr + block * _RECORD_WORDS * 8).to(tl.pointer_type(tl.int64))
            tl.store(rec + 1, count)
            tl.store(rec + 4, seen)
            tl.atomic_xchg(rec, tl.full((), 1, tl.int64) * _TIMEOUT, sem="release", scope="sys")
            tl.atomic_xchg(state, tl.full((), 1, tl.int64), sem="release", scope="sys")


def launch(
    *,
    mc_base: int,
    peers: object,
    offset: int,
    signal_offset: int,
    state_addr: int,
    record_addr: int,
    rank: int,
    world: int,
    lo: int,
    hi: int,
    timeout_ns: int,
    dtype: object,
    op: int,
    unit_elems: int,
    blocks: int,
) -> None:
    """Launch ``multimem_all_reduce_kernel`` over ``blocks`` blocks (see the module docstring)."""
    multimem_all_reduce_kernel[(blocks,)](
        mc_base,
        peers,
        offset,
        signal_offset,
        state_addr,
        record_addr,
        rank,
        world,
        lo,
        hi,
        timeout_ns,
        DTYPE=dtype,
        OP=op,
        UNIT_ELEMS=unit_elems,
        LANES=32 * NUM_WARPS,
        num_warps=NUM_WARPS,
    )
