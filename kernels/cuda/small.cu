// The small-message all_reduce: a one-shot whose addresses and sizes are its parameters. The
// CUDA C++ twin of kernels/triton/small.py (read its docstring for the model); the two agree on
// every layout.
//
// The program kernel (program.cu) reads its work from tables: the instruction row, then the
// operand, then the peer's base address, three global loads in series before the first byte of
// a peer moves. Here each rank's half 0 and flag area are parameters (at most MAX_WORLD of
// each): the one global load a peer address depends on is this channel's epoch, whose parity
// picks the half (tests/ops/test_small_ptx.py counts it in the sm_90 PTX).
//
// Per channel (block) c: copy this channel's share of the tensor into this rank's half e0 % 2 at
// the same position; SYNC (the call's identity words beside, then release (e0 + 1) << FP_BITS |
// fingerprint into channel c's flag at every rank, acquire-wait for every rank's, bounded by
// timeout_ns on %globaltimer, and compare the words beside it: common.cuh's sync_flags); fold every
// rank's staged share in rank order (common.cuh's reduce_span: the accumulation type, AVG divides
// once, one rounding) over the tensor. The halves, flags, state words ([poison, epoch of channel
// 0, ...]), error records and poison are the program kernel's, so launches of the two interleave
// on one workspace and a timeout or another call's fingerprint ends in the same record.
//
// Memory order is the program kernel's (docs/kernel-contract.md, "One memory contract"): every
// data load is __ldcg (copy_span, reduce_span); the SYNC is a block barrier, then the release
// stores, and the acquire polls, then a block barrier. No __threadfence_system(): the flags
// announce this block's own copy-in, not data written by earlier kernels.
//
// Kernels: gpucomm_small_<op>_<dtype> for every op (sum, prod, min, max, avg) x dtype. Launch with
// one block of GPUCOMM_THREADS threads per channel.

#include "common.cuh"

namespace {

// Ranks served: one parameter per rank's half and flag area.
constexpr int MAX_WORLD = 8;

static_assert(GPUCOMM_THREADS >= MAX_WORLD, "thread p signals and waits for rank p");

// One address per rank, held in registers from the parameters: rank j's by selects, so that a
// rank chosen at run time reads no table (an array indexed at run time would live in memory).
struct PerRank {
    gc_u64 a0, a1, a2, a3, a4, a5, a6, a7;
    __device__ __forceinline__ gc_u64 operator()(int j) const {
        return j == 0 ? a0 : j == 1 ? a1 : j == 2 ? a2 : j == 3 ? a3 : j == 4 ? a4 : j == 5 ? a5 : j == 6 ? a6 : a7;
    }
};

// The sources of the fold: rank j's staged share, `offset` bytes into its half 0.
struct Staged {
    PerRank stages;
    gc_u64 offset;
    __device__ __forceinline__ gc_u64 operator()(int j) const { return stages(j) + offset; }
};

// Channel `channel`'s flags: the one rank `writer` writes in rank `owner`'s flag area.
struct SmallFlags {
    PerRank areas;  // by value: the addresses stay in registers
    int channel, world;
    __device__ __forceinline__ gc_i64* operator()(int owner, int writer) const {
        return (gc_i64*)areas(owner) + (gc_i64)channel * world + writer;
    }
    __device__ __forceinline__ const gc_i64* area(int owner) const { return (const gc_i64*)areas(owner); }
};

// dst = src over nbytes by the threads of this block: 16-byte vectors where both addresses and
// the size allow, otherwise units of the element's size (the share's bounds are whole elements).
template <class S>
__device__ __forceinline__ void copy_in(gc_u64 dst, gc_u64 src, gc_u64 nbytes) {
    if (((dst | src | nbytes) & 15) == 0) {
        gpucomm::copy_span<uint4>(dst, src, nbytes / 16, threadIdx.x, blockDim.x);
    } else {
        gpucomm::copy_span<S>(dst, src, nbytes / sizeof(S), threadIdx.x, blockDim.x);
    }
}

template <class D, class Op>
__device__ __forceinline__ void small_all_reduce(gc_u64 x, gc_i64 n, const PerRank& stages, const PerRank& areas,
                                                 gc_i64 half_bytes, gc_i64* state, gc_i64* record, int rank, int world,
                                                 gc_i64 fingerprint, gc_u64 timeout_ns, int all_channels,
                                                 gc_i64 divisor, const gpucomm::Identity& id) {
    typedef typename D::S S;
    constexpr gc_i64 V = 16 / sizeof(S);
    __shared__ gc_i64 seen[MAX_WORLD];
    const int channel = blockIdx.x, channels = gridDim.x;
    // The one global load every peer address depends on: its parity picks the half.
    const gc_i64 e0 = state[1 + channel];
    // One thread looks at the poison for the whole block; the barrier also orders every
    // thread's read of the epoch before thread 0 stores it back.
    const bool poisoned = __syncthreads_or(threadIdx.x == 0 && gpucomm::load_acquire_sys(state) != 0);
    gc_i64 e = e0;
    if (!poisoned) {
        // [lo, hi): this channel's share of the elements, whole 16-byte vectors from the start.
        const gc_i64 share = ((n + channels - 1) / channels + V - 1) / V * V;
        const gc_i64 lo = min((gc_i64)channel * share, n), hi = min(lo + share, n);
        const gc_u64 offset = (gc_u64)((e0 & 1) * half_bytes + lo * (gc_i64)sizeof(S));
        const gc_u64 nbytes = (gc_u64)(hi - lo) * sizeof(S);
        copy_in<S>(stages(rank) + offset, x + lo * sizeof(S), nbytes);
        e = e0 + 1;
        // The SYNC: every rank signalled and awaited (common.cuh's sync_flags, as program.cu's).
        const SmallFlags flags{areas, channel, world};
        if (gpucomm::sync_flags(flags, ~0ull, ~0ull, rank, world, channel, e, fingerprint, timeout_ns,
                                gpucomm::SMALL_SYNC_INSTRUCTION, seen, record, state, id)) {
            gpucomm::reduce_span<D, Op>(x + lo * sizeof(S), Staged{stages, offset}, world, (gc_u64)(hi - lo),
                                        Op::divides, divisor, threadIdx.x, blockDim.x);
        }
    }
    // Channel c also keeps the epochs of channels c + grid, c + 2 * grid, ... (program.cu).
    if (threadIdx.x == 0) {
        for (int c = channel; c < all_channels; c += channels) state[1 + c] = e;
    }
}

}  // namespace

// The parameters of every small kernel (gpucomm.ops.cuda_ops.SMALL_PARAMS, in this order).
#define GPUCOMM_SMALL_PARAMS                                                                          \
    gc_u64 x, gc_i64 n, gc_u64 stage0, gc_u64 stage1, gc_u64 stage2, gc_u64 stage3, gc_u64 stage4,    \
        gc_u64 stage5, gc_u64 stage6, gc_u64 stage7, gc_u64 flags0, gc_u64 flags1, gc_u64 flags2,     \
        gc_u64 flags3, gc_u64 flags4, gc_u64 flags5, gc_u64 flags6, gc_u64 flags7, gc_i64 half_bytes, \
        gc_i64 *state, gc_i64 *record, int rank, int world, gc_i64 fingerprint, gc_u64 timeout_ns,    \
        int all_channels, gc_i64 divisor, gc_i64 ident_word, gc_i64 ident0, gc_i64 ident1

#define GPUCOMM_SMALL_KERNEL(op_name, OpType, dtype_name, DType)                                      \
    extern "C" __global__ void __launch_bounds__(GPUCOMM_THREADS)                                    \
        gpucomm_small_##op_name##_##dtype_name(GPUCOMM_SMALL_PARAMS) {                               \
        small_all_reduce<DType, OpType>(                                                              \
            x, n, PerRank{stage0, stage1, stage2, stage3, stage4, stage5, stage6, stage7},            \
            PerRank{flags0, flags1, flags2, flags3, flags4, flags5, flags6, flags7}, half_bytes, state,  \
            record, rank, world, fingerprint, timeout_ns, all_channels, divisor,                      \
            gpucomm::Identity{ident_word, all_channels, ident0, ident1});                             \
    }

GPUCOMM_FOR_EACH_OP_AND_DTYPE(GPUCOMM_SMALL_KERNEL)
