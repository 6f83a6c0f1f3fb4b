// Shared device code of gpucomm's CUDA C++ kernels.
//
// Compiled at run time by NVRTC (gpucomm/ops/cuda_ops.py) and ahead of time by nvcc in CI
// (tests/ops/test_cuda_compile.py), so it includes no header at all: NVRTC finds none, not even
// cuda_fp16.h or cuda_bf16.h, without the toolkit's include directory, which a pip-installed CUDA
// does not have (checked with NVRTC 13.5). Integer types are spelled without <cstdint>, and the
// 16-bit float conversions are written out below.
//
// Numerics: every float operation goes through an explicitly rounded intrinsic (__fadd_rn,
// __fmul_rn, __fdiv_rn, ...), which the compiler never contracts into an FMA, so results are
// bitwise those of the torch reference (gpucomm/ops/reference.py) whatever --fmad says.

#pragma once

// Threads per block; the loader passes -DGPUCOMM_THREADS so that host and device agree.
#ifndef GPUCOMM_THREADS
#define GPUCOMM_THREADS 512
#endif

// The instruction set, from gpucomm/ops/instruction_set.py: the loader passes each number as a
// -D option (gpucomm.ops.cuda_ops.compile_options), so that the kernels read the builder's values.
#if !defined(GPUCOMM_WORDS) || !defined(GPUCOMM_OPERAND_WORDS) || !defined(GPUCOMM_COPY) ||   \
    !defined(GPUCOMM_REDUCE) || !defined(GPUCOMM_SYNC) || !defined(GPUCOMM_FP_BITS) ||        \
    !defined(GPUCOMM_RECORD_WORDS) || !defined(GPUCOMM_TIMEOUT) || !defined(GPUCOMM_MISMATCH) || \
    !defined(GPUCOMM_SMALL_SYNC_INSTRUCTION) || !defined(GPUCOMM_IDENT_WORDS) ||                 \
    !defined(GPUCOMM_IDENT_BITS) || !defined(GPUCOMM_IDENT_TAG_MASK) || !defined(GPUCOMM_STORE_ALSO) || \
    !defined(GPUCOMM_CARRIED)
#error "gpucomm: compile with gpucomm.ops.cuda_ops.compile_options, which defines the instruction set"
#endif

typedef unsigned long long gc_u64;
typedef long long gc_i64;

namespace gpucomm {

constexpr int WORDS = GPUCOMM_WORDS;                  // int64 per instruction
constexpr int OPERAND_WORDS = GPUCOMM_OPERAND_WORDS;  // int64 per operand
constexpr int COPY = GPUCOMM_COPY;                    // opcodes
constexpr int REDUCE = GPUCOMM_REDUCE;
constexpr int SYNC = GPUCOMM_SYNC;
constexpr int STORE_ALSO = GPUCOMM_STORE_ALSO;  // a REDUCE's flag (word 7): a second destination
constexpr int CARRIED = GPUCOMM_CARRIED;        // a COPY's flag (word 7): the REDUCE before it runs it
constexpr int FP_BITS = GPUCOMM_FP_BITS;  // a flag: (epoch << FP_BITS) | fingerprint
constexpr gc_i64 FP_MASK = (1ll << FP_BITS) - 1;
// Beside each flag, the call's identity words (gpucomm/ops/program.py, "Identity"): IDENT_WORDS
// int64, each (epoch & IDENT_TAG_MASK) << IDENT_BITS | the call's word.
constexpr int IDENT_WORDS = GPUCOMM_IDENT_WORDS;
constexpr int IDENT_BITS = GPUCOMM_IDENT_BITS;
constexpr int IDENT_TAG_MASK = GPUCOMM_IDENT_TAG_MASK;
constexpr int RECORD_WORDS = GPUCOMM_RECORD_WORDS;  // int64 per channel's error record
constexpr int TIMEOUT = GPUCOMM_TIMEOUT;            // kinds of error record
constexpr int MISMATCH = GPUCOMM_MISMATCH;
// The instruction a small kernel's error record names: the SYNC of its program (COPY, SYNC, REDUCE).
constexpr int SMALL_SYNC_INSTRUCTION = GPUCOMM_SMALL_SYNC_INSTRUCTION;

__device__ __forceinline__ gc_u64 global_thread() {
    return (gc_u64)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ gc_u64 grid_threads() {
    return (gc_u64)gridDim.x * blockDim.x;
}

// ---------------------------------------------------------------------------------------------
// Flags: int64 epoch counters, written with release and read with acquire at system scope, so
// that a peer GPU (NVLink / PCIe through CUDA IPC) or the host sees the data written before.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ void store_release_sys(gc_i64* flag, gc_i64 value) {
#ifdef GPUCOMM_HOST  // the host build's twin (kernels/cuda/host_shim.h)
    gpucomm_host::store_release(flag, value);
#else
    asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
#endif
}

__device__ __forceinline__ gc_i64 load_acquire_sys(const gc_i64* flag) {
#ifdef GPUCOMM_HOST
    return __atomic_load_n(flag, __ATOMIC_ACQUIRE);
#else
    gc_i64 value;
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
    return value;
#endif
}

// Nanoseconds of the GPU's global timer; only differences are used.
__device__ __forceinline__ gc_u64 global_timer_ns() {
#ifdef GPUCOMM_HOST
    return gpucomm_host::clock_ns();
#else
    gc_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#endif
}

// Wait, in this block alone, until every flag in flag_addrs[0..n) is >= epoch, or until
// timeout_ns passed since this block started waiting. Returns true if all arrived. Blocks never
// wait on each other: each block polls the flags itself.
//
// status (host-initialised to {0, epoch, epoch, ...}) receives the error record of a timeout:
// status[0] = 1, and status[1 + i] = the smallest value of flag i that any block saw when it gave
// up (left at epoch for flags that arrived). atomicMin keeps the record consistent when several
// blocks of one launch time out: a flag missing in any block stays below epoch in the record.
__device__ __forceinline__ bool wait_flags_block(const gc_u64* flag_addrs, int n, gc_i64 epoch,
                                                 gc_u64 timeout_ns, gc_i64* status) {
    __shared__ int missing;
    if (threadIdx.x == 0) missing = 0;
    __syncthreads();
    const gc_u64 start = global_timer_ns();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const gc_i64* flag = (const gc_i64*)flag_addrs[i];
        gc_i64 seen = load_acquire_sys(flag);
        // Once the deadline passed, each remaining flag still gets one look, so a thread with
        // several flags never blocks past the deadline by more than those loads.
        while (seen < epoch && global_timer_ns() - start <= timeout_ns) {
            seen = load_acquire_sys(flag);
        }
        if (seen < epoch) {
            missing = 1;
            atomicMin(&status[1 + i], seen);
        }
    }
    // The barrier makes every thread's acquired view the block's view before it reads peer data.
    __syncthreads();
    if (missing) {
        if (threadIdx.x == 0) atomicExch((gc_u64*)&status[0], 1ull);
        return false;
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// The SYNC of program.cu and small.cu: flags that carry (epoch << FP_BITS) | fingerprint, one per
// channel and writer in each rank's flag area, and the error record a failed SYNC writes.
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ gc_i64 flag_value(gc_i64 e) { return (gc_i64)((gc_u64)e << FP_BITS); }

// seen has not reached target: a signed difference, so that the test survives wraparound.
__device__ __forceinline__ bool behind(gc_i64 seen, gc_i64 target) {
    return (gc_i64)((gc_u64)seen - (gc_u64)target) < 0;
}

// A flag at epoch e that carries another call's fingerprint.
__device__ __forceinline__ bool other_call(gc_i64 seen, gc_i64 e, gc_i64 fingerprint) {
    return (seen >> FP_BITS) == e && (seen & FP_MASK) != fingerprint;
}

// Acquire-load a flag until it reaches target or timeout_ns have passed; the last value seen.
__device__ __forceinline__ gc_i64 poll(const gc_i64* at, gc_i64 target, gc_u64 timeout_ns) {
    gc_i64 seen = load_acquire_sys(at);
    const gc_u64 start = global_timer_ns();
    while (behind(seen, target) && global_timer_ns() - start <= timeout_ns) {
        seen = load_acquire_sys(at);
    }
    return seen;
}

// A word `seen` stored beside a flag at the epoch whose tagged word of this call is `mine` (its
// tag is that epoch's): a word with another tag was rewritten by a peer two epochs on.
__device__ __forceinline__ bool same_epoch(gc_i64 seen, gc_i64 mine) { return ((seen ^ mine) >> IDENT_BITS) == 0; }

// The call's identity words (gpucomm.ops.program.identity), as a SYNC stores and compares them.
struct Identity {
    gc_i64 first_slot;  // the flag area's first identity slot (int64 words)
    int channels;       // channels of the flag layout
    gc_i64 word0, word1;
    // The slot (e's parity, channel, writer) in the flag area at `area`: IDENT_WORDS int64.
    __device__ __forceinline__ gc_i64* slot(const gc_i64* area, gc_i64 e, int channel, int world, int writer) const {
        return (gc_i64*)area + first_slot + (((e & 1) * channels + channel) * (gc_i64)world + writer) * IDENT_WORDS;
    }
};

// Write `channel`'s error record (RECORD_WORDS int64 at record) from the flags of the `world`
// ranks seen at SYNC `instruction` (epoch e) and the ranks whose identity words of epoch e were
// another call's (`other_ident`), then poison the workspace's later launches (state[0]). A
// mismatch outranks a timeout, as in the Triton kernels. One thread calls it.
__device__ void record_error(gc_i64* record, gc_i64* state, int channel, int world, gc_i64 e, gc_i64 instruction,
                             const gc_i64* seen, gc_i64 fingerprint, gc_u64 other_ident) {
    gc_u64 late = 0, other = other_ident;
    for (int p = 0; p < world; ++p) {
        if (behind(seen[p], flag_value(e))) late |= 1ull << p;
        if (other_call(seen[p], e, fingerprint)) other |= 1ull << p;
    }
    const gc_u64 culprits = other ? other : late;
    gc_i64* rec = record + (gc_i64)channel * RECORD_WORDS;
    rec[1] = e;
    rec[2] = instruction;
    rec[3] = (gc_i64)culprits;
    rec[4] = seen[__ffsll((gc_i64)culprits) - 1];
    rec[5] = fingerprint;
    // The kind last, with release: whoever sees it sees the fields.
    store_release_sys(rec, other ? MISMATCH : TIMEOUT);
    store_release_sys(state, 1);
}

// One SYNC of `channel` at epoch e by the threads of this block (program.cu's, and small.cu's
// with every rank in both masks). Thread p < world stores the call's identity words (tagged with
// e) into its slot of e's parity in rank p's flag area and releases (e << FP_BITS) | fingerprint
// into rank p's flag of this rank (flag_at(p, rank)) if bit p of signal_mask is set, then polls
// this rank's flag of rank p (flag_at(rank, p)) until it reaches epoch e or timeout_ns pass, if
// bit p of wait_mask is set (a rank not awaited reads as arrived), and compares the identity
// words rank p stored beside it (flag_at.area(owner): a rank's flag area). Returns true if every
// awaited rank arrived with this call's fingerprint and identity; otherwise thread 0 has written
// the error record of SYNC `instruction` (from seen[], one value per rank in shared memory) and
// the channel must stop.
template <class FlagAt>
__device__ __forceinline__ bool sync_flags(const FlagAt& flag_at, gc_u64 signal_mask, gc_u64 wait_mask, int rank,
                                           int world, int channel, gc_i64 e, gc_i64 fingerprint, gc_u64 timeout_ns,
                                           gc_i64 instruction, gc_i64* seen, gc_i64* record, gc_i64* state,
                                           const Identity& id) {
    __shared__ gc_u64 other_ident;  // ranks whose identity words of epoch e are another call's
    const gc_i64 value = flag_value(e) | fingerprint;
    const gc_i64 tag = (e & IDENT_TAG_MASK) << IDENT_BITS;
    const gc_i64 word0 = tag | id.word0, word1 = tag | id.word1;
    const bool identified = id.word0 != 0;  // words 0: a launch without an identity stores and compares none
    const int p = threadIdx.x;
    if (p == 0) other_ident = 0;
    // Every thread's data is written before any flag is released: the barrier orders the other
    // threads' writes before the release store (which is cumulative), at system scope.
    __syncthreads();
    bool failed = false;
    if (p < world) {
        if (signal_mask >> p & 1) {
            if (identified) {  // the identity words before the flag: its release publishes them
                gc_i64* words = id.slot(flag_at.area(p), e, channel, world, rank);
                words[0] = word0;
                words[1] = word1;
            }
            store_release_sys(flag_at(p, rank), value);
        }
        const bool awaited = wait_mask >> p & 1;
        const gc_i64 got = awaited ? poll(flag_at(rank, p), flag_value(e), timeout_ns) : value;
        seen[p] = got;
        failed = behind(got, flag_value(e)) || other_call(got, e, fingerprint);
        if (identified && awaited && !behind(got, flag_value(e))) {
            const gc_i64* words = id.slot(flag_at.area(rank), e, channel, world, p);
            const gc_i64 seen0 = load_acquire_sys(words), seen1 = load_acquire_sys(words + 1);
            if (same_epoch(seen0, word0) && same_epoch(seen1, word1) && (seen0 != word0 || seen1 != word1)) {
                atomicOr(&other_ident, 1ull << p);
                failed = true;
            }
        }
    }
    // Every thread reads peer data only after the acquires above; the verdict is the block's.
    if (!__syncthreads_or(failed)) return true;
    if (p == 0) record_error(record, state, channel, world, e, instruction, seen, fingerprint, other_ident);
    return false;
}

// ---------------------------------------------------------------------------------------------
// Reduce: element types (storage S, accumulation A) and operators.
// ---------------------------------------------------------------------------------------------

struct F32 {
    typedef float S;
    typedef float A;
    static __device__ __forceinline__ A load(S x) { return x; }
    static __device__ __forceinline__ S store(A a) { return a; }
};

struct F64 {
    typedef double S;
    typedef double A;
    static __device__ __forceinline__ A load(S x) { return x; }
    static __device__ __forceinline__ S store(A a) { return a; }
};

// 16-bit floats are stored as raw bits so that they can live in a union with uint4; they
// accumulate in fp32 and round once, to nearest even, at the store. The conversions are those of
// cuda_fp16.h / cuda_bf16.h, written out (see the top of this file).
__device__ __forceinline__ float f16_to_f32(unsigned short bits) {
#ifdef GPUCOMM_HOST
    return gpucomm_host::f16_to_f32(bits);
#else
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
#endif
}

__device__ __forceinline__ unsigned short f32_to_f16_rn(float value) {
#ifdef GPUCOMM_HOST
    return gpucomm_host::f32_to_f16_rn(value);
#else
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    return bits;
#endif
}

// bf16 is the top half of an fp32: widening is exact.
__device__ __forceinline__ float bf16_to_f32(unsigned short bits) { return __uint_as_float((unsigned)bits << 16); }

// Round to nearest, ties to even, in integer arithmetic (every architecture from sm_70; the same
// formula as torch's and the Triton kernels'). A NaN stays a quiet NaN rather than carrying into
// the exponent.
__device__ __forceinline__ unsigned short f32_to_bf16_rn(float value) {
    const unsigned bits = __float_as_uint(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((bits >> 16) | 0x40u);
    return (unsigned short)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

struct F16 {
    typedef unsigned short S;
    typedef float A;
    static __device__ __forceinline__ A load(S x) { return f16_to_f32(x); }
    static __device__ __forceinline__ S store(A a) { return f32_to_f16_rn(a); }
};

struct BF16 {
    typedef unsigned short S;
    typedef float A;
    static __device__ __forceinline__ A load(S x) { return bf16_to_f32(x); }
    static __device__ __forceinline__ S store(A a) { return f32_to_bf16_rn(a); }
};

struct I32 {
    typedef int S;
    typedef int A;
    static __device__ __forceinline__ A load(S x) { return x; }
    static __device__ __forceinline__ S store(A a) { return a; }
};

struct I64 {
    typedef gc_i64 S;
    typedef gc_i64 A;
    static __device__ __forceinline__ A load(S x) { return x; }
    static __device__ __forceinline__ S store(A a) { return a; }
};

// Integer sums and products wrap (two's complement) like torch's; unsigned arithmetic keeps
// the overflow defined.
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ int add(int a, int b) { return (int)((unsigned)a + (unsigned)b); }
__device__ __forceinline__ gc_i64 add(gc_i64 a, gc_i64 b) { return (gc_i64)((gc_u64)a + (gc_u64)b); }

__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ int mul(int a, int b) { return (int)((unsigned)a * (unsigned)b); }
__device__ __forceinline__ gc_i64 mul(gc_i64 a, gc_i64 b) { return (gc_i64)((gc_u64)a * (gc_u64)b); }

// AVG divides once, in the accumulation type: IEEE division for floats, truncation for integers.
__device__ __forceinline__ float divide(float a, gc_i64 d) { return __fdiv_rn(a, (float)d); }
__device__ __forceinline__ double divide(double a, gc_i64 d) { return __ddiv_rn(a, (double)d); }
__device__ __forceinline__ int divide(int a, gc_i64 d) { return a / (int)d; }
__device__ __forceinline__ gc_i64 divide(gc_i64 a, gc_i64 d) { return a / d; }

// torch.minimum / torch.maximum: a NaN in either operand gives NaN. (The sign of a tie between
// -0.0 and +0.0 is unspecified, as it is in torch.)
template <class A> __device__ __forceinline__ bool is_nan(A x) { return x != x; }
template <class A> __device__ __forceinline__ A min_nan(A a, A b) {
    if (is_nan(a)) return a;
    if (is_nan(b)) return b;
    return b < a ? b : a;
}
template <class A> __device__ __forceinline__ A max_nan(A a, A b) {
    if (is_nan(a)) return a;
    if (is_nan(b)) return b;
    return a < b ? b : a;
}

// A fold operator: apply(a, b) combines two values in the accumulation type; AVG folds as a sum
// and `divides` marks it so that the reduction divides once at the end.
struct OpSum {
    static constexpr bool divides = false;
    template <class A> static __device__ __forceinline__ A apply(A a, A b) { return add(a, b); }
};
struct OpProd {
    static constexpr bool divides = false;
    template <class A> static __device__ __forceinline__ A apply(A a, A b) { return mul(a, b); }
};
struct OpMin {
    static constexpr bool divides = false;
    template <class A> static __device__ __forceinline__ A apply(A a, A b) { return min_nan(a, b); }
};
struct OpMax {
    static constexpr bool divides = false;
    template <class A> static __device__ __forceinline__ A apply(A a, A b) { return max_nan(a, b); }
};
struct OpAvg {
    static constexpr bool divides = true;
    template <class A> static __device__ __forceinline__ A apply(A a, A b) { return add(a, b); }
};

// Accesses at integer addresses. A pointer made from an integer is generic (the compiler cannot
// know which space it points into), so these say "global" explicitly; .cg keeps the data in L2
// only: it is moved once, and L1 is not coherent with writes by peer GPUs.
template <class T> __device__ __forceinline__ T load_global(gc_u64 addr) { return __ldcg((const T*)addr); }
template <class T> __device__ __forceinline__ void store_global(gc_u64 addr, T value) { __stcg((T*)addr, value); }

// Words of a copy a thread loads before it stores any: 4 16-byte vectors are 16 of the 128
// registers a thread of a 512-thread block may have.
constexpr int COPY_WORDS_IN_FLIGHT = 4;

// dst[i] = src[i] for the words i in [0, n) of type W, by thread `tid` of `stride` cooperating
// threads, which takes every stride-th word, as a copy of one word at a time would. A step of a
// thread covers U words, stride apart, so that a warp's loads stay contiguous: it issues the U
// loads (U in flight), then the U stores. The words past the last whole step, fewer than U per
// thread, go one at a time. Every word is read and written by the thread that owns it, so dst may
// be src itself; no other overlap.
//
// The whole steps test nothing against n: a step that tested each word (one loop, as
// reduce_vectors has) made program.cu's copy-only kernel take 113-115 registers and its other
// kernels spill 142-202 bytes each (ptxas -v, nvcc 13.0, sm_80 and sm_90); this, 64 registers
// and 0-30 bytes per kernel (tests/ops/test_cuda_compile.py lists them), none in a COPY or REDUCE loop.
template <class W>
__device__ __forceinline__ void copy_span(gc_u64 dst, gc_u64 src, gc_u64 n, gc_u64 tid, gc_u64 stride) {
    constexpr int U = COPY_WORDS_IN_FLIGHT;
    gc_u64 i = tid;
    for (; i + (U - 1) * stride < n; i += U * stride) {
        W w[U];
#pragma unroll
        for (int u = 0; u < U; ++u) w[u] = load_global<W>(src + (i + u * stride) * sizeof(W));
        // The loads come first in the source: the compiler may not move a load above a store to
        // an address it cannot tell apart.
#pragma unroll
        for (int u = 0; u < U; ++u) store_global<W>(dst + (i + u * stride) * sizeof(W), w[u]);
    }
    for (; i < n; i += stride) store_global<W>(dst + i * sizeof(W), load_global<W>(src + i * sizeof(W)));
}

// The source addresses of a reduction read from a device table (reduce.cu). Other callers pass
// any type with the same operator() (program.cu resolves them from its operand table).
struct SourceTable {
    const gc_u64* addrs;
    __device__ __forceinline__ gc_u64 operator()(int j) const { return addrs[j]; }
};

// Sources a reduce loads before it folds; a reduce of more loads one after the other.
constexpr int MAX_LOADED_SOURCES = 8;
// 16-byte vectors a thread loads of every source in one step: 2 x 8 sources are 64 of the 128
// registers a thread of a 512-thread block may have. More, or a loop per source count (1, 2, 4,
// 8, as the Triton kernel has), made ptxas spill hundreds of bytes inside the loops (nvcc 13.0).
constexpr int VECTORS_PER_SOURCE = 2;

// The vector body of reduce_span: vectors [0, nvec) of 16 bytes, of k <= MAX_LOADED_SOURCES
// sources. A step of a thread covers U vectors, stride apart, so that a warp's loads stay
// contiguous: it issues the U loads of every source (U * k in flight), then folds each vector,
// every element in source order exactly as one vector at a time would, and stores it.
// What a reduce without carried copies runs between its loads and its folds: nothing.
struct NoCarry {
    __device__ __forceinline__ void step() {}
};

template <class D, class Op, class Sources, class Carry>
__device__ __forceinline__ void reduce_vectors(gc_u64 out, const Sources& src, int k, gc_u64 nvec, bool divides,
                                               gc_i64 divisor, gc_u64 tid, gc_u64 stride, gc_u64 out2,
                                               Carry* carry) {
    typedef typename D::S S;
    typedef typename D::A A;
    constexpr int V = 16 / sizeof(S);
    constexpr int U = VECTORS_PER_SOURCE;
    union Vec {
        uint4 raw;
        S e[V];
    };
    for (gc_u64 v0 = tid; v0 < nvec; v0 += U * stride) {
        // Raw vectors: an array of unions would live in local memory.
        uint4 in[MAX_LOADED_SOURCES][U];
        // A source's address is asked for where it is used, not kept across the loop: 8 of them
        // held in registers (16 more) made the program kernels spill.
#pragma unroll
        for (int j = 0; j < MAX_LOADED_SOURCES; ++j) {
            if (j < k) {
                const gc_u64 from = src(j);
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    if (v0 + u * stride < nvec) in[j][u] = load_global<uint4>(from + (v0 + u * stride) * 16);
                }
            }
        }
        // A carried copy's share (kernels/cuda/program.cu's Carry) while these loads are in flight.
        if (carry != nullptr) carry->step();
        // Every source of a vector is read before it is stored: out may alias one.
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (v0 + u * stride < nvec) {
                Vec x;
                A acc[V];
                x.raw = in[0][u];
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] = D::load(x.e[e]);
#pragma unroll
                for (int j = 1; j < MAX_LOADED_SOURCES; ++j) {
                    if (j < k) {
                        x.raw = in[j][u];
#pragma unroll
                        for (int e = 0; e < V; ++e) acc[e] = Op::apply(acc[e], D::load(x.e[e]));
                    }
                }
#pragma unroll
                for (int e = 0; e < V; ++e) x.e[e] = D::store(divides ? divide(acc[e], divisor) : acc[e]);
                store_global<uint4>(out + (v0 + u * stride) * 16, x.raw);
                if (out2 != 0) store_global<uint4>(out2 + (v0 + u * stride) * 16, x.raw);
            }
        }
    }
}

// out[i] = op(...op(op(src(0)[i], src(1)[i]), src(2)[i])..., src(k-1)[i]) for i in [0, n), folded
// in the accumulation type, divided once by `divisor` if `divides`, rounded once at the store.
// Thread `tid` of `stride` cooperating threads takes every stride-th element (or vector). out may
// alias a source at the same offset: each element is read from every source before it is written.
// out2, where not 0, is a second destination that gets the same rounded values from the same
// thread right after out (the program kernel's REDUCE with STORE_ALSO); it may alias a source too.
// carry, where not null, is called once per iteration of the vector body between its loads and its
// folds (the program kernel's carried copies: their share of the iteration).
//
// When out and every source are 16-byte aligned, the body moves uint4 vectors and a scalar loop
// takes the last n % V elements; otherwise everything goes through the scalar loop.
template <class D, class Op, class Sources, class Carry = NoCarry>
__device__ __forceinline__ void reduce_span(gc_u64 out, const Sources& src, int k, gc_u64 n, bool divides,
                                            gc_i64 divisor, gc_u64 tid, gc_u64 stride, gc_u64 out2 = 0,
                                            Carry* carry = nullptr) {
    typedef typename D::S S;
    typedef typename D::A A;
    const int V = 16 / sizeof(S);
    union Vec {
        uint4 raw;
        S e[V];
    };

    gc_u64 any_bits = out | out2;
    for (int j = 0; j < k; ++j) any_bits |= src(j);
    const gc_u64 nvec = (any_bits & 15) == 0 ? n / V : 0;

    if (k <= MAX_LOADED_SOURCES) {
        reduce_vectors<D, Op>(out, src, k, nvec, divides, divisor, tid, stride, out2, carry);
    } else {
        // More sources (no algorithm below 9 ranks a node makes them): one after the other.
        for (gc_u64 v = tid; v < nvec; v += stride) {
            Vec in;
            A acc[V];
            in.raw = load_global<uint4>(src(0) + v * 16);
#pragma unroll
            for (int e = 0; e < V; ++e) acc[e] = D::load(in.e[e]);
            for (int j = 1; j < k; ++j) {
                in.raw = load_global<uint4>(src(j) + v * 16);
#pragma unroll
                for (int e = 0; e < V; ++e) acc[e] = Op::apply(acc[e], D::load(in.e[e]));
            }
            Vec res;
#pragma unroll
            for (int e = 0; e < V; ++e) res.e[e] = D::store(divides ? divide(acc[e], divisor) : acc[e]);
            store_global<uint4>(out + v * 16, res.raw);
            if (out2 != 0) store_global<uint4>(out2 + v * 16, res.raw);
        }
    }

    for (gc_u64 i = nvec * V + tid; i < n; i += stride) {
        A acc = D::load(load_global<S>(src(0) + i * sizeof(S)));
        for (int j = 1; j < k; ++j) acc = Op::apply(acc, D::load(load_global<S>(src(j) + i * sizeof(S))));
        const S res = D::store(divides ? divide(acc, divisor) : acc);
        store_global<S>(out + i * sizeof(S), res);
        if (out2 != 0) store_global<S>(out2 + i * sizeof(S), res);
    }
}

// reduce_span over the whole grid, sources from a device table of k addresses; AVG divides.
template <class D, class Op>
__device__ __forceinline__ void reduce_grid(void* out, const gc_u64* srcs, int k, gc_u64 n, gc_i64 divisor) {
    reduce_span<D, Op>((gc_u64)out, SourceTable{srcs}, k, n, Op::divides, divisor, global_thread(), grid_threads());
}

}  // namespace gpucomm

// Instantiate MACRO(op_name, OpType, dtype_name, DType) for every op x dtype. The names match
// torch's dtype names and gpucomm.ops.cuda_ops.reduce_kernel_name().
#define GPUCOMM_FOR_EACH_DTYPE(MACRO, op_name, OpType) \
    MACRO(op_name, OpType, float32, gpucomm::F32)      \
    MACRO(op_name, OpType, float64, gpucomm::F64)      \
    MACRO(op_name, OpType, float16, gpucomm::F16)      \
    MACRO(op_name, OpType, bfloat16, gpucomm::BF16)    \
    MACRO(op_name, OpType, int32, gpucomm::I32)        \
    MACRO(op_name, OpType, int64, gpucomm::I64)

// The folds: every op but AVG, which folds as a sum (the program kernels divide per instruction).
#define GPUCOMM_FOR_EACH_FOLD_AND_DTYPE(MACRO)                \
    GPUCOMM_FOR_EACH_DTYPE(MACRO, sum, gpucomm::OpSum)        \
    GPUCOMM_FOR_EACH_DTYPE(MACRO, prod, gpucomm::OpProd)      \
    GPUCOMM_FOR_EACH_DTYPE(MACRO, min, gpucomm::OpMin)        \
    GPUCOMM_FOR_EACH_DTYPE(MACRO, max, gpucomm::OpMax)

#define GPUCOMM_FOR_EACH_OP_AND_DTYPE(MACRO)                  \
    GPUCOMM_FOR_EACH_FOLD_AND_DTYPE(MACRO)                    \
    GPUCOMM_FOR_EACH_DTYPE(MACRO, avg, gpucomm::OpAvg)
