// The program kernel: one launch runs a whole collective, its waits included. The CUDA C++ twin
// of kernels/triton/program.py (read its docstring for the model); the two agree on every layout.
//
// A *program* is a table of instructions that every rank runs in the same order. Each block of
// the grid is one *channel*: it runs every instruction but moves only the bytes whose in-half
// position falls in the granules it owns (granule g belongs to channel g % channels), and it
// syncs only with the same channel of the other ranks. Blocks never wait for each other, so
// nothing depends on which of them are resident at once.
//
// Instructions (WORDS int64 each):
//   COPY   nbytes pos 1 operand                    operands[operand] = operands[operand + 1] (one move: word 3 is 1)
//   REDUCE nbytes pos k operand divide divisor flags  operands[operand] = fold of the k after it;
//          with STORE_ALSO in flags, operands[operand + k + 1] = the same (stored right after it)
//   COPY ... with CARRIED in its word 7, right after a REDUCE (two at most): run inside that REDUCE,
//          a share of it in every iteration of the fold's vector body, between the fold's loads and
//          its folds (Carry below), the rest after the fold; the main loop skips it
//   SYNC   signal_mask wait_mask fence             advance the epoch e; if fence, __threadfence_system()
//          (the data announced was written by earlier kernels); store the call's identity
//          words beside, then release-store (e << FP_BITS) | fingerprint into this channel's flag
//          at every rank of signal_mask; acquire-wait for the flag of every rank of wait_mask to
//          reach epoch e and compare the identity words beside it (gpucomm/ops/program.py)
// An operand (OPERAND_WORDS int64) is [-1, 0, address] or [rank, round, offset]: offset bytes
// into the half of `rank` that data of `round` lives in, half (epoch at launch + round) % 2.
//
// State on the device (state = [poison, epoch of channel 0, epoch of channel 1, ...], in the
// rank's own flag area): a launch loads its channel's epoch, advances it and stores it back, so
// a replayed CUDA graph goes on from where the last launch left off. Every wait ends by its
// deadline (%globaltimer); a timeout, or a peer's flag at this epoch with another fingerprint
// (or identity words of this epoch that are not this call's), writes the channel's error record
// (RECORD_WORDS int64 at record, in host memory the device reaches through UVA: [kind, epoch,
// instruction, culprit rank mask, value seen, fingerprint], the kind stored last with release),
// sets the poison word and ends the channel; every later launch sees the poison and does nothing.
//
// Kernels: gpucomm_program_<op>_<dtype> for every fold op (sum, prod, min, max; AVG folds as a
// sum and its REDUCEs divide) x dtype, and gpucomm_program_copy for programs without a REDUCE.
// Launch with one block of GPUCOMM_THREADS threads per channel.

#include "common.cuh"

namespace {

// The instruction set: common.cuh's.
using gpucomm::COPY;
using gpucomm::OPERAND_WORDS;
using gpucomm::REDUCE;
using gpucomm::CARRIED;
using gpucomm::STORE_ALSO;
using gpucomm::SYNC;
using gpucomm::WORDS;

// A SYNC names its peers in an int64 bit mask.
constexpr int MAX_PEERS = 64;
// Operand addresses an instruction resolves once into shared memory: a one-shot reduce over
// every rank needs MAX_PEERS at most. Operands beyond (no algorithm makes them) are resolved
// where they are read.
constexpr int CACHED_OPERANDS = MAX_PEERS;

static_assert(GPUCOMM_THREADS >= MAX_PEERS, "thread p signals and waits for rank p");

// What one launch of one channel knows: the kernel's arguments, its place in the grid and the
// channel's epoch at launch.
struct Launch {
    const gc_i64* prog;      // the instructions
    gc_i64 n_instr;          // how many
    const gc_i64* operands;  // the operands they name
    const gc_i64* peers;     // each rank's half-0 address, then each rank's flag-area address
    gc_i64* state;           // [poison, epoch of channel 0, epoch of channel 1, ...]
    gc_i64* record;          // RECORD_WORDS int64 per channel
    int rank;                // this rank, in the workspace
    int world;               // ranks of the workspace (<= MAX_PEERS - 1)
    gc_i64 fingerprint;      // of the call: every flag carries it (< 2**FP_BITS)
    gc_i64 half_bytes;       // bytes from half 0 to half 1
    gc_i64 granule;          // bytes of in-half positions a channel owns in turn
    gc_u64 timeout_ns;       // a wait gives up after this long
    int all_channels;        // channels of the flag layout (epochs in state), >= the grid
    gc_i64 ident_word;       // the flag area's first identity slot (int64 words)
    gc_i64 ident0, ident1;   // the call's identity words, stored beside every flag
    int channel;             // this block
    int channels;            // the grid
    gc_i64 e0;               // the channel's epoch at launch: it picks the half of every round
};

// ---------------------------------------------------------------------------------------------
// COPY and REDUCE
// ---------------------------------------------------------------------------------------------

// The address operand `index` names, in this process.
__device__ __forceinline__ gc_u64 address(const Launch& L, gc_i64 index) {
    const gc_i64* operand = L.operands + index * OPERAND_WORDS;
    const gc_i64 peer = operand[0], round = operand[1], offset = operand[2];
    if (peer < 0) return (gc_u64)offset;
    return (gc_u64)(L.peers[peer] + ((L.e0 + round) & 1) * L.half_bytes + offset);
}

// Operand j of an instruction whose first operand is `first`.
struct Operands {
    const Launch* L;
    const gc_u64* cached;
    gc_i64 first;
    __device__ __forceinline__ gc_u64 operator()(int j) const {
        return j < CACHED_OPERANDS ? cached[j] : address(*L, first + j);
    }
};

// The sources of a REDUCE (the operands after its output), `lo` bytes in: reduce_span's view.
struct Sources {
    Operands operands;
    gc_u64 lo;
    __device__ __forceinline__ gc_u64 operator()(int j) const { return operands(1 + j) + lo; }
};

// Resolve the first operands of an instruction into shared memory, one thread each.
__device__ __forceinline__ void cache_operands(const Launch& L, gc_i64 first, int count, gc_u64* cached) {
    __syncthreads();  // every thread is done with the last instruction's operands
    if ((int)threadIdx.x < count && threadIdx.x < CACHED_OPERANDS) cached[threadIdx.x] = address(L, first + threadIdx.x);
    __syncthreads();
}

// dst = src over nbytes, by the threads of this block: 16-byte vectors while both addresses are
// 16-byte aligned, the rest in the widest unit that divides both addresses and the size. The
// units follow from the addresses themselves, so that no access can ever be misaligned. Each unit
// goes through common.cuh's copy_span: COPY_WORDS_IN_FLIGHT loads of a thread before its stores.
__device__ __forceinline__ void copy_range(gc_u64 dst, gc_u64 src, gc_u64 nbytes) {
    const gc_u64 body = ((dst | src) & 15) == 0 ? nbytes / 16 * 16 : 0;
    gpucomm::copy_span<uint4>(dst, src, body / 16, threadIdx.x, blockDim.x);
    dst += body;
    src += body;
    nbytes -= body;
    const gc_u64 bits = dst | src | nbytes;
    if ((bits & 7) == 0) {
        gpucomm::copy_span<gc_u64>(dst, src, nbytes / sizeof(gc_u64), threadIdx.x, blockDim.x);
    } else if ((bits & 3) == 0) {
        gpucomm::copy_span<unsigned int>(dst, src, nbytes / sizeof(unsigned int), threadIdx.x, blockDim.x);
    } else if ((bits & 1) == 0) {
        gpucomm::copy_span<unsigned short>(dst, src, nbytes / sizeof(unsigned short), threadIdx.x, blockDim.x);
    } else {
        gpucomm::copy_span<unsigned char>(dst, src, nbytes / sizeof(unsigned char), threadIdx.x, blockDim.x);
    }
}

// An instruction's word 7 (its flags), loaded whole: a test of one bit of it would otherwise become a
// narrow load, and the tests hold the table's plain loads to whole words.
__device__ __forceinline__ gc_i64 flags_word(const gc_i64* row) {
    return gpucomm::load_global<gc_i64>((gc_u64)(row + 7));
}

// The COPYs a REDUCE carries (up to two ranges, kernels/triton/carry.py's model): the bytes of
// each range at the in-half positions this channel owns, numbered in order, the first range's and
// then the second's, and cut into shares of `quota` bytes. Share j is [j * quota, (j + 1) * quota);
// thread t moves its units of it (every blockDim.x-th from the share's start), so every unit has one
// thread whatever number of fold iterations each thread runs: step() moves the thread's units of the
// next share, rest() of every share it has not reached. Only the fold's 16-byte vector body calls
// step(): a fold whose addresses are not all 16-byte aligned leaves every share to rest(), after it
// (the float32 two-shots of whole MiB the model times are aligned throughout). What every thread
// shares (the ranges and the shares' size: a CarryPlan) lives in shared memory, written once by
// thread 0: kept in registers across the fold's loop it made ptxas spill there. A thread keeps
// only its share count.
struct Range {
    gc_u64 dst, src;
    gc_i64 pos, n;
    // This channel's first granule of the range (g0), where its bytes start there (start0) and how
    // many that granule holds (len): CarryPlan::first's, worked out once by carried(). Recomputed for
    // every unit, they were three more 64-bit divisions a unit (a call each on a GPU) in the loop.
    gc_i64 g0, start0, len;
};

struct CarryPlan {
    Range a, b;
    gc_i64 owned_a, granule, total, quota;
    int channel, channels, unit;

    // Where this channel's bytes of range r start (start0), the granule that holds them (g0), and
    // how many of them that granule holds (len).
    __device__ __forceinline__ void first(const Range& r, gc_i64& g0, gc_i64& start0, gc_i64& len) const {
        const gc_i64 g_first = r.pos / granule;
        g0 = g_first + (channel - g_first % channels + channels) % channels;
        start0 = max(g0 * granule, r.pos);
        len = min((g0 + 1) * granule, r.pos + r.n) - start0;
    }
    __device__ __forceinline__ gc_i64 owned_bytes(const Range& r) const {
        gc_i64 g0, start0, len;
        first(r, g0, start0, len);
        if (r.n <= 0 || len <= 0) return 0;
        const gc_i64 end = r.pos + r.n;
        const gc_i64 count = ((end - 1) / granule - g0) / channels + 1;
        const gc_i64 tail = max((g0 + (count - 1) * channels + 1) * granule - end, (gc_i64)0);
        return count * granule - (start0 - g0 * granule) - tail;
    }
    // The offset from r.pos of this channel's v-th owned byte of range r.
    // One division: rest's granule and its offset in it, from the quotient.
    __device__ __forceinline__ gc_i64 offset(const Range& r, gc_i64 v) const {
        if (v < r.len) return r.start0 - r.pos + v;
        const gc_i64 rest = v - r.len;
        const gc_i64 turns = rest / granule;
        return (r.g0 + (turns + 1) * channels) * granule + (rest - turns * granule) - r.pos;
    }
    // A range with its first granule worked out (the fields offset() reads).
    __device__ __forceinline__ Range located(Range r) const {
        first(r, r.g0, r.start0, r.len);
        return r;
    }
    __device__ __forceinline__ void move_unit(gc_u64 d, gc_u64 s) const {
        switch (unit) {
            case 16: gpucomm::store_global<uint4>(d, gpucomm::load_global<uint4>(s)); break;
            case 8: gpucomm::store_global<gc_u64>(d, gpucomm::load_global<gc_u64>(s)); break;
            case 4: gpucomm::store_global<unsigned int>(d, gpucomm::load_global<unsigned int>(s)); break;
            case 2: gpucomm::store_global<unsigned short>(d, gpucomm::load_global<unsigned short>(s)); break;
            default: gpucomm::store_global<unsigned char>(d, gpucomm::load_global<unsigned char>(s)); break;
        }
    }
};

// A thread's walk through a CarryPlan's shares.
struct Carry {
    const CarryPlan* plan;
    gc_i64 next;

    __device__ __forceinline__ void share() {
        const CarryPlan& p = *plan;
        const gc_i64 lo = next * p.quota, hi = min(lo + p.quota, p.total);
        ++next;
        for (gc_i64 v = lo + (gc_i64)threadIdx.x * p.unit; v < hi; v += (gc_i64)blockDim.x * p.unit) {
            const bool in_a = v < p.owned_a;
            const Range& r = in_a ? p.a : p.b;
            const gc_i64 off = p.offset(r, in_a ? v : v - p.owned_a);
            p.move_unit(r.dst + off, r.src + off);
        }
    }
    __device__ __forceinline__ void step() {
        if (next * plan->quota < plan->total) share();
    }
    __device__ __forceinline__ void rest() {
        while (next * plan->quota < plan->total) share();
    }
};

// The carried COPYs of the REDUCE at `row` (n_carried of them, 1 or 2), and how this channel shares
// them over the fold's iterations: about one share per iteration of the vector body over the
// REDUCE's bytes this channel owns.
__device__ __forceinline__ CarryPlan carried(const Launch& L, const gc_i64* row, int n_carried) {
    CarryPlan c;
    c.granule = L.granule;
    c.channel = L.channel;
    c.channels = L.channels;
    const gc_i64* ra = row + WORDS;
    const gc_i64* rb = row + (n_carried > 1 ? 2 : 1) * WORDS;
    c.a = c.located(Range{address(L, ra[4]), address(L, ra[4] + 1), ra[2], ra[1], 0, 0, 0});
    c.b = c.located(Range{address(L, rb[4]), address(L, rb[4] + 1), rb[2], n_carried > 1 ? rb[1] : 0, 0, 0, 0});
    const gc_u64 bits = (gc_u64)L.granule | c.a.dst | c.a.src | (gc_u64)c.a.pos | (gc_u64)c.a.n | c.b.dst | c.b.src |
                        (gc_u64)c.b.pos | (gc_u64)c.b.n;
    c.unit = (bits & 15) == 0 ? 16 : (bits & 7) == 0 ? 8 : (bits & 3) == 0 ? 4 : (bits & 1) == 0 ? 2 : 1;
    c.owned_a = c.owned_bytes(c.a);
    c.total = c.owned_a + c.owned_bytes(c.b);
    // The REDUCE's own bytes of this channel, counted with the same rule.
    const gc_i64 fold = c.owned_bytes(Range{0, 0, row[2], row[1], 0, 0, 0});
    const gc_i64 iteration = (gc_i64)gpucomm::VECTORS_PER_SOURCE * 16 * blockDim.x;
    const gc_i64 steps = max((fold + iteration - 1) / iteration, (gc_i64)1);
    c.quota = max(((c.total + steps - 1) / steps + c.unit - 1) / c.unit * c.unit, (gc_i64)c.unit);
    return c;
}

// One REDUCE's bytes [lo, lo + nbytes), by the threads of this block, with common.cuh's numerics.
template <class D, class Op>
struct Fold {
    template <class C>
    static __device__ __forceinline__ void range(const Operands& operands, int n_src, gc_i64 lo, gc_i64 nbytes,
                                                 bool divides, gc_i64 divisor, bool also, C* carry) {
        const gc_u64 out2 = also ? operands(n_src + 1) + lo : 0;  // the second destination, after the sources
        gpucomm::reduce_span<D, Op>(operands(0) + lo, Sources{operands, (gc_u64)lo}, n_src,
                                    nbytes / sizeof(typename D::S), divides, divisor, threadIdx.x, blockDim.x, out2,
                                    carry);
    }
};

// The copy-only kernel's: gpucomm.ops.program sets a program's dtype with its first REDUCE, and the
// host launches this kernel only for programs without a dtype, so it never meets a REDUCE.
template <>
struct Fold<void, void> {
    template <class C>
    static __device__ __forceinline__ void range(const Operands&, int, gc_i64, gc_i64, bool, gc_i64, bool, C*) {}
};

// The granules of [pos, pos + nbytes) this channel owns: a COPY's, or a REDUCE's with `carry`'s
// shares in its fold's iterations (NoCarry: none).
template <class D, class Op, class C>
__device__ __forceinline__ void granules(const Launch& L, const gc_i64* row, bool reduces, const Operands& operands,
                                         bool also, C* carry) {
    const gc_i64 nbytes = row[1], pos = row[2];
    const int n_src = (int)row[3];
    const gc_i64 end = pos + nbytes;
    const gc_i64 g_first = pos / L.granule;
    gc_i64 g = g_first + (L.channel - g_first % L.channels + L.channels) % L.channels;
    for (; g * L.granule < end; g += L.channels) {
        const gc_i64 lo = max(g * L.granule, pos) - pos;
        const gc_i64 hi = min((g + 1) * L.granule, end) - pos;
        if (reduces) {
            Fold<D, Op>::range(operands, n_src, lo, hi - lo, row[5] != 0, row[6], also, carry);
        } else {
            copy_range(operands(0) + lo, operands(1) + lo, hi - lo);
        }
    }
}

// Whether a program kernel folds (its dtype D is not void): only those run carried copies, and the
// copy-only kernel then compiles none of them (their plan made ptxas spill 62 bytes in it, sm_90).
template <class D> struct Folds { static constexpr bool value = true; };
template <> struct Folds<void> { static constexpr bool value = false; };

// One COPY or REDUCE, on the granules of [pos, pos + nbytes) this channel owns; a REDUCE with the
// n_carried COPYs after it.
template <class D, class Op>
__device__ __forceinline__ void move(const Launch& L, const gc_i64* row, bool reduces, gc_u64* cached, int n_carried,
                                     CarryPlan* plan) {
    const gc_i64 first = row[4];
    const int n_src = (int)row[3];
    const bool also = reduces && (flags_word(row) & STORE_ALSO) != 0;
    cache_operands(L, first, n_src + 1 + (also ? 1 : 0), cached);
    const Operands operands{&L, cached, first};
    if (Folds<D>::value && n_carried > 0) {
        // The next instruction's cache_operands waits for every thread before thread 0 writes again.
        if (threadIdx.x == 0) *plan = carried(L, row, n_carried);
        __syncthreads();
        Carry carry{plan, 0};
        granules<D, Op>(L, row, reduces, operands, also, &carry);
        carry.rest();  // what the fold's iterations left (all of it where this channel owns none of the fold)
    } else {
        granules<D, Op>(L, row, reduces, operands, also, (gpucomm::NoCarry*)nullptr);
    }
}

// ---------------------------------------------------------------------------------------------
// SYNC and errors
// ---------------------------------------------------------------------------------------------

// This channel's flag that rank `writer` writes, in rank `owner`'s flag area.
__device__ __forceinline__ gc_i64* flag(const Launch& L, int owner, int writer) {
    return (gc_i64*)L.peers[L.world + owner] + (gc_i64)L.channel * L.world + writer;
}

// This channel's flags as common.cuh's sync_flags addresses them, and each rank's flag area.
struct ChannelFlags {
    const Launch* L;
    __device__ __forceinline__ gc_i64* operator()(int owner, int writer) const { return flag(*L, owner, writer); }
    __device__ __forceinline__ const gc_i64* area(int owner) const { return (const gc_i64*)L->peers[L->world + owner]; }
};

// One SYNC of this channel at its new epoch e (common.cuh's sync_flags, with the row's masks).
// True if every awaited rank arrived with this call's fingerprint and identity words; otherwise
// the error record is written and the channel must stop.
__device__ bool sync(const Launch& L, const gc_i64* row, gc_i64 e, gc_i64 instruction, gc_i64* seen) {
    // A fenced SYNC announces data this rank's earlier kernels wrote (a symmetric tensor read in
    // place), which the block's release does not order: the system-scope fence first makes it
    // visible, as gpucomm_signal does (docs/kernel-contract.md). The other SYNCs need none.
    if (row[3] != 0) __threadfence_system();
    return gpucomm::sync_flags(ChannelFlags{&L}, (gc_u64)row[1], (gc_u64)row[2], L.rank, L.world, L.channel, e,
                               L.fingerprint, L.timeout_ns, instruction, seen, L.record, L.state,
                               gpucomm::Identity{L.ident_word, L.all_channels, L.ident0, L.ident1});
}

// ---------------------------------------------------------------------------------------------
// The kernel body
// ---------------------------------------------------------------------------------------------

template <class D, class Op>
__device__ __forceinline__ void run_program(Launch L) {
    __shared__ gc_u64 cached[CACHED_OPERANDS];
    __shared__ gc_i64 seen[MAX_PEERS];
    __shared__ CarryPlan plan;  // of the REDUCE that carries COPYs, while it runs
    L.e0 = L.state[1 + L.channel];
    // One thread looks at the poison for the whole block (another channel may set it meanwhile,
    // and every thread must take the same path); the barrier also orders every thread's read of
    // the epoch before thread 0 stores it back.
    const bool poisoned = __syncthreads_or(threadIdx.x == 0 && gpucomm::load_acquire_sys(L.state) != 0);
    gc_i64 e = L.e0;
    bool running = !poisoned;
    for (gc_i64 i = 0; running && i < L.n_instr; ++i) {
        const gc_i64* row = L.prog + i * WORDS;
        const gc_i64 opcode = row[0];
        if (opcode == SYNC) {
            running = sync(L, row, ++e, i, seen);
        } else if (opcode == COPY || opcode == REDUCE) {
            // A REDUCE runs the COPYs flagged CARRIED right after it (two at most); they are skipped here.
            int n_carried = 0;
            while (opcode == REDUCE && n_carried < 2 && i + 1 + n_carried < L.n_instr &&
                   row[(1 + n_carried) * WORDS] == COPY && (flags_word(row + (1 + n_carried) * WORDS) & CARRIED) != 0) {
                ++n_carried;
            }
            move<D, Op>(L, row, opcode == REDUCE, cached, n_carried, &plan);
            i += n_carried;
        }
        // Any other row moves nothing (the executor uploads none: it launches no program without instructions).
    }
    // A launch may run fewer channels than the flag layout has (small messages run one): channel
    // c also keeps the epochs of channels c + grid, c + 2 * grid, ..., so that every channel
    // counts every SYNC and a later launch, whatever its grid, starts from one epoch.
    if (threadIdx.x == 0) {
        for (int c = L.channel; c < L.all_channels; c += L.channels) L.state[1 + c] = e;
    }
}

}  // namespace

// The arguments of every program kernel (gpucomm.ops.cuda_ops.CudaKernels.run_program passes them).
#define GPUCOMM_PROGRAM_PARAMS                                                                        \
    const gc_i64 *prog, gc_i64 n_instr, const gc_i64 *operands, const gc_i64 *peers, gc_i64 *state,   \
        gc_i64 *record, int rank, int world, gc_i64 fingerprint, gc_i64 half_bytes, gc_i64 granule,    \
        gc_u64 timeout_ns, int all_channels, gc_i64 ident_word, gc_i64 ident0, gc_i64 ident1
#define GPUCOMM_PROGRAM_LAUNCH                                                                        \
    Launch{prog, n_instr, operands, peers, state, record, rank, world, fingerprint, half_bytes,        \
           granule, timeout_ns, all_channels, ident_word, ident0, ident1, (int)blockIdx.x, (int)gridDim.x, 0}

#define GPUCOMM_PROGRAM_KERNEL(op_name, OpType, dtype_name, DType)                                   \
    extern "C" __global__ void __launch_bounds__(GPUCOMM_THREADS)                                    \
        gpucomm_program_##op_name##_##dtype_name(GPUCOMM_PROGRAM_PARAMS) {                           \
        run_program<DType, OpType>(GPUCOMM_PROGRAM_LAUNCH);                                          \
    }

GPUCOMM_FOR_EACH_FOLD_AND_DTYPE(GPUCOMM_PROGRAM_KERNEL)

extern "C" __global__ void __launch_bounds__(GPUCOMM_THREADS) gpucomm_program_copy(GPUCOMM_PROGRAM_PARAMS) {
    run_program<void, void>(GPUCOMM_PROGRAM_LAUNCH);
}
