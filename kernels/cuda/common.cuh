// Shared device code of gpucomm's CUDA C++ kernels.
//
// Compiled at run time by NVRTC (gpucomm/ops/cuda_ops.py) and ahead of time by nvcc in CI
// (tests/test_cuda_compile.py), so it includes only the headers NVRTC ships (cuda_fp16.h,
// cuda_bf16.h) and spells integer types without <cstdint>.
//
// Numerics: every float operation goes through an explicitly rounded intrinsic (__fadd_rn,
// __fmul_rn, __fdiv_rn, ...), which the compiler never contracts into an FMA, so results are
// bitwise those of the torch reference (gpucomm/ops/reference.py) whatever --fmad says.

#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// Threads per block; the loader passes -DGPUCOMM_THREADS so that host and device agree.
#ifndef GPUCOMM_THREADS
#define GPUCOMM_THREADS 512
#endif

typedef unsigned long long gc_u64;
typedef long long gc_i64;

namespace gpucomm {

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
    asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

__device__ __forceinline__ gc_i64 load_acquire_sys(const gc_i64* flag) {
    gc_i64 value;
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
    return value;
}

// Nanoseconds of the GPU's global timer; only differences are used.
__device__ __forceinline__ gc_u64 global_timer_ns() {
    gc_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
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
// accumulate in fp32 and round once, to nearest even, at the store.
struct F16 {
    typedef unsigned short S;
    typedef float A;
    static __device__ __forceinline__ A load(S x) { return __half2float(__ushort_as_half(x)); }
    static __device__ __forceinline__ S store(A a) { return __half_as_ushort(__float2half_rn(a)); }
};

struct BF16 {
    typedef unsigned short S;
    typedef float A;
    static __device__ __forceinline__ A load(S x) { return __bfloat162float(__ushort_as_bfloat16(x)); }
    static __device__ __forceinline__ S store(A a) { return __bfloat16_as_ushort(__float2bfloat16_rn(a)); }
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

struct OpSum {
    template <class A> static __device__ __forceinline__ A apply(A a, A b) { return add(a, b); }
    template <class A> static __device__ __forceinline__ A finish(A a, gc_i64) { return a; }
};
struct OpProd {
    template <class A> static __device__ __forceinline__ A apply(A a, A b) { return mul(a, b); }
    template <class A> static __device__ __forceinline__ A finish(A a, gc_i64) { return a; }
};
struct OpMin {
    template <class A> static __device__ __forceinline__ A apply(A a, A b) { return min_nan(a, b); }
    template <class A> static __device__ __forceinline__ A finish(A a, gc_i64) { return a; }
};
struct OpMax {
    template <class A> static __device__ __forceinline__ A apply(A a, A b) { return max_nan(a, b); }
    template <class A> static __device__ __forceinline__ A finish(A a, gc_i64) { return a; }
};
struct OpAvg {
    template <class A> static __device__ __forceinline__ A apply(A a, A b) { return add(a, b); }
    template <class A> static __device__ __forceinline__ A finish(A a, gc_i64 d) { return divide(a, d); }
};

// out[i] = finish(op(...op(op(src0[i], src1[i]), src2[i])..., src_{k-1}[i])), element by element,
// over the whole grid. srcs is a device table of k addresses. out may alias a source at the same
// offset: each element is read from every source before it is written.
//
// When out and every source are 16-byte aligned, the body moves uint4 vectors and a scalar loop
// takes the last n % V elements; otherwise everything goes through the scalar loop. Sources are
// read with __ldcg (global space, cached in L2 only): the addresses arrive as integers, so plain
// loads would be generic, and L1 holds nothing worth keeping for data read once.
template <class D, class Op>
__device__ __forceinline__ void reduce_grid(void* out, const gc_u64* srcs, int k, gc_u64 n,
                                            gc_i64 divisor) {
    typedef typename D::S S;
    typedef typename D::A A;
    const int V = 16 / sizeof(S);
    union Vec {
        uint4 raw;
        S e[V];
    };

    gc_u64 any_bits = (gc_u64)out;
    for (int j = 0; j < k; ++j) any_bits |= srcs[j];
    const gc_u64 nvec = (any_bits & 15) == 0 ? n / V : 0;
    const gc_u64 tid = global_thread();
    const gc_u64 stride = grid_threads();

    for (gc_u64 v = tid; v < nvec; v += stride) {
        Vec in;
        A acc[V];
        in.raw = __ldcg((const uint4*)srcs[0] + v);
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = D::load(in.e[e]);
        for (int j = 1; j < k; ++j) {
            in.raw = __ldcg((const uint4*)srcs[j] + v);
#pragma unroll
            for (int e = 0; e < V; ++e) acc[e] = Op::apply(acc[e], D::load(in.e[e]));
        }
        Vec res;
#pragma unroll
        for (int e = 0; e < V; ++e) res.e[e] = D::store(Op::finish(acc[e], divisor));
        ((uint4*)out)[v] = res.raw;
    }

    for (gc_u64 i = nvec * V + tid; i < n; i += stride) {
        A acc = D::load(__ldcg((const S*)srcs[0] + i));
        for (int j = 1; j < k; ++j) acc = Op::apply(acc, D::load(__ldcg((const S*)srcs[j] + i)));
        ((S*)out)[i] = D::store(Op::finish(acc, divisor));
    }
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

#define GPUCOMM_FOR_EACH_OP_AND_DTYPE(MACRO)                  \
    GPUCOMM_FOR_EACH_DTYPE(MACRO, sum, gpucomm::OpSum)        \
    GPUCOMM_FOR_EACH_DTYPE(MACRO, prod, gpucomm::OpProd)      \
    GPUCOMM_FOR_EACH_DTYPE(MACRO, min, gpucomm::OpMin)        \
    GPUCOMM_FOR_EACH_DTYPE(MACRO, max, gpucomm::OpMax)        \
    GPUCOMM_FOR_EACH_DTYPE(MACRO, avg, gpucomm::OpAvg)
