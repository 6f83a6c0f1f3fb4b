// The host build of gpucomm's CUDA C++ kernels: what g++ needs to compile kernels/cuda/*.cu
// unchanged and run them on CPU memory (GPUCOMM_CUDA_EMULATE=1, gpucomm/ops/cuda_host.py).
//
// A generated file includes this header, then one .cu file, then names its kernels
// (gpucomm/ops/cuda_host.py writes it); the kernels never say #ifdef. The only other host code is
// the twin of each inline asm body in common.cuh, behind #ifdef GPUCOMM_HOST, which this header
// defines.
//
// Execution model:
// - a launch runs every block, one after the other, in an order drawn from the launch's seed (the
//   same seed and grid give the same order in every process, so that channel c of every rank runs
//   at its turn: blocks pair with the same block of the peers, never with another block);
// - each GPU thread of a block is a fiber (its own stack and registers, ucontext); __syncthreads
//   and __syncthreads_or switch fibers until every live thread of the block has arrived, as a
//   block barrier does, and a thread polling a flag lets the others run on; __shared__ is per OS thread storage, which every fiber of the block sees;
// - flag loads and stores are real atomics with the order the CUDA code declares (the peers are
//   other processes mapping the same /dev/shm), __threadfence_system a sequentially consistent
//   fence; a release store yields the CPU, so that a peer may act on the flag before this block's
//   other threads run on; the twin of %globaltimer is the monotonic clock, and it yields the CPU
//   so that a waiting rank lets the ranks it waits for run on a machine with fewer cores than ranks;
// - a misaligned __ldcg/__stcg (a fault on a GPU) and two threads of one block at different kinds
//   of barrier (a hang or undefined behaviour on a GPU) end the process with a message naming the
//   kernel, block, thread and seed.
//
// Build: g++ -std=c++17 -O2 -ffp-contract=off (no FMA contraction: the _rn intrinsics below are
// single IEEE operations, bitwise those of the GPU and of torch).

#pragma once

#define GPUCOMM_HOST 1

#include <sched.h>
#include <time.h>
#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

// ---------------------------------------------------------------------------------------------
// Keywords and built-in types
// ---------------------------------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
// One block runs at a time on an OS thread, so per-thread storage is the block's shared memory.
#define __shared__ static thread_local

struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};

struct uint3 {
    unsigned int x, y, z;
};

namespace gpucomm_host {

// What the running fiber (GPU thread) is, and its launch.
struct Here {
    uint3 thread{0, 0, 0};
    uint3 block{0, 0, 0};
    uint3 block_dim{1, 1, 1};
    uint3 grid_dim{1, 1, 1};
    const char* kernel = "";
    unsigned long long seed = 0;
};

inline Here& here() {
    static thread_local Here h;
    return h;
}

[[noreturn]] inline void trap(const char* what) {
    const Here& h = here();
    std::fprintf(stderr,
                 "gpucomm: CUDA kernel trap (host build, GPUCOMM_CUDA_EMULATE): %s in %s, block %u thread %u "
                 "(grid %u, block size %u; block order seed %llu)\n",
                 what, h.kernel, h.block.x, h.thread.x, h.grid_dim.x, h.block_dim.x, h.seed);
    std::fflush(stderr);
    std::abort();
}

void barrier(int kind, int predicate, int* result);

}  // namespace gpucomm_host

#define threadIdx (::gpucomm_host::here().thread)
#define blockIdx (::gpucomm_host::here().block)
#define blockDim (::gpucomm_host::here().block_dim)
#define gridDim (::gpucomm_host::here().grid_dim)

// ---------------------------------------------------------------------------------------------
// Intrinsics
// ---------------------------------------------------------------------------------------------

inline void __syncthreads() { ::gpucomm_host::barrier(0, 0, nullptr); }

inline int __syncthreads_or(int predicate) {
    int result = 0;
    ::gpucomm_host::barrier(1, predicate != 0, &result);
    return result;
}

inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline long long atomicMin(long long* address, long long value) {
    long long old = __atomic_load_n(address, __ATOMIC_RELAXED);
    while (value < old && !__atomic_compare_exchange_n(address, &old, value, false, __ATOMIC_RELAXED,
                                                       __ATOMIC_RELAXED)) {
    }
    return old;
}

inline unsigned long long atomicExch(unsigned long long* address, unsigned long long value) {
    return __atomic_exchange_n(address, value, __ATOMIC_RELAXED);
}

inline unsigned long long atomicOr(unsigned long long* address, unsigned long long value) {
    return __atomic_fetch_or(address, value, __ATOMIC_RELAXED);
}

namespace gpucomm_host {
template <class T> inline void check_aligned(const void* p, const char* access) {
    if (reinterpret_cast<std::uintptr_t>(p) % sizeof(T) != 0) {
        char what[160];
        std::snprintf(what, sizeof what, "misaligned %zu-byte %s at address %p (a GPU faults: misaligned address)",
                      sizeof(T), access, p);
        trap(what);
    }
}
}  // namespace gpucomm_host

// Loads and stores of data "cached in L2": plain accesses here, at their natural alignment only.
template <class T> inline T __ldcg(const T* p) {
    ::gpucomm_host::check_aligned<T>(p, "load");
    T value;
    std::memcpy(&value, p, sizeof(T));
    return value;
}

template <class T> inline void __stcg(T* p, T value) {
    ::gpucomm_host::check_aligned<T>(p, "store");
    std::memcpy(p, &value, sizeof(T));
}

inline int __ffsll(long long x) { return __builtin_ffsll(x); }

inline unsigned int __float_as_uint(float x) {
    unsigned int u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}

inline float __uint_as_float(unsigned int u) {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}

// One IEEE operation each, rounded to nearest even (SSE2 / AArch64 scalar arithmetic, and no FMA
// contraction with -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }

// CUDA's overloaded min and max of integers.
inline int min(int a, int b) { return b < a ? b : a; }
inline int max(int a, int b) { return a < b ? b : a; }
inline long long min(long long a, long long b) { return b < a ? b : a; }
inline long long max(long long a, long long b) { return a < b ? b : a; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return b < a ? b : a; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a < b ? b : a; }

// ---------------------------------------------------------------------------------------------
// The twins of common.cuh's inline asm bodies
// ---------------------------------------------------------------------------------------------

namespace gpucomm_host {

void fiber_yield();

inline unsigned long long clock_ns() {
    // A waiting thread reads the clock once per poll: let the block's other threads run on (they
    // run at once on a GPU: a thread waiting for one peer must not keep its neighbour from
    // signalling another), and the peers it waits for (a node of 8 ranks on 2 cores would
    // otherwise spin whole time slices away).
    fiber_yield();
    sched_yield();
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (unsigned long long)t.tv_sec * 1000000000ull + (unsigned long long)t.tv_nsec;
}

// A release store, then the CPU to whoever waits for it: a peer polling this flag may run at once
// and read what the flag announces while the other threads of this block have not yet reached
// their next barrier, which is where a flag stored before its data shows.
inline void store_release(long long* flag, long long value) {
    __atomic_store_n(flag, value, __ATOMIC_RELEASE);
    sched_yield();
}

// IEEE binary16 bits to binary32: exact.
inline float f16_to_f32(unsigned short h) {
    const unsigned sign = (unsigned)(h & 0x8000u) << 16;
    unsigned exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (mant << 13);  // inf, NaN (payload kept)
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        do {
            ++e;
            mant <<= 1;
        } while ((mant & 0x400u) == 0);
        bits = sign | ((unsigned)(112 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
    return __uint_as_float(bits);
}

// binary32 to binary16, rounded to nearest, ties to even (cvt.rn.f16.f32); a NaN stays a NaN.
inline unsigned short f32_to_f16_rn(float value) {
    const unsigned bits = __float_as_uint(value);
    const unsigned short sign = (unsigned short)((bits >> 16) & 0x8000u);
    const unsigned abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // NaN
    if (abs >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // rounds to inf, or is inf
    if (abs < 0x38800000u) {
        // A half subnormal (or zero): value / 2^-24, rounded to nearest even.
        if (abs < 0x33000000u) return sign;  // below half of the smallest subnormal: +-0
        const unsigned exp = abs >> 23;
        const unsigned mant = (abs & 0x7fffffu) | 0x800000u;
        const unsigned shift = 126u - exp;  // 14 .. 24 bits go
        const unsigned half = mant >> shift;
        const unsigned rest = mant & ((1u << shift) - 1u), mid = 1u << (shift - 1u);
        const unsigned up = rest > mid || (rest == mid && (half & 1u));
        return (unsigned short)(sign | (half + up));
    }
    // Normal: rebias the exponent, round the 13 bits that go (a carry may reach inf: correct).
    const unsigned r = abs - 0x38000000u;
    const unsigned rest = r & 0x1fffu;
    unsigned half = r >> 13;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
    return (unsigned short)(sign | half);
}

// ---------------------------------------------------------------------------------------------
// Fibers: the threads of a block
// ---------------------------------------------------------------------------------------------

// Bytes of stack per GPU thread; the kernels' frames take a few hundred, a trap's message a few KiB
// (ThreadSanitizer's instrumentation more).
#if defined(__SANITIZE_THREAD__)
constexpr size_t STACK_BYTES = 256 << 10;
#else
constexpr size_t STACK_BYTES = 64 << 10;
#endif

// Under ThreadSanitizer (tests/ops/test_cuda_tsan.py) each fiber is a TSan fiber, and every switch
// between a fiber and the scheduler synchronises (so a block barrier orders the block's threads);
// ranks are OS threads, ordered only by the flags' acquire and release.
#if defined(__SANITIZE_THREAD__)
}  // namespace gpucomm_host
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_destroy_fiber(void* fiber);
}
namespace gpucomm_host {
inline void* tsan_current() { return __tsan_get_current_fiber(); }
inline void* tsan_create() { return __tsan_create_fiber(0); }
inline void tsan_destroy(void* fiber) {
    if (fiber) __tsan_destroy_fiber(fiber);
}
inline void tsan_switch(void* fiber) { __tsan_switch_to_fiber(fiber, 0); }
#else
inline void* tsan_current() { return nullptr; }
inline void* tsan_create() { return nullptr; }
inline void tsan_destroy(void*) {}
inline void tsan_switch(void*) {}
#endif

struct Fiber {
    ucontext_t context;
    std::vector<char> stack;
    void* tsan = nullptr;  // its ThreadSanitizer fiber (tsan builds only)
    bool done = false;
    bool waiting = false;  // at a barrier
    int kind = 0;          // which barrier: 0 __syncthreads, 1 __syncthreads_or
    int predicate = 0;
    int* result = nullptr;
};

struct Block {
    ucontext_t scheduler;
    void* tsan_scheduler = nullptr;
    std::vector<Fiber> fibers;
    int current = 0;
    void (*body)(void**) = nullptr;
    void** params = nullptr;
};

inline Block& block() {
    static thread_local Block b;
    return b;
}

inline void fiber_entry() {
    Block& b = block();
    b.body(b.params);
    Fiber& f = b.fibers[b.current];
    f.done = true;
    // Back to the scheduler for good (it never resumes a thread that is done). Not by returning:
    // under ThreadSanitizer this frame's exit would run on the scheduler's TSan fiber.
    tsan_switch(b.tsan_scheduler);
    swapcontext(&f.context, &b.scheduler);
}

// Let the block's other threads run until they end, reach a barrier or yield too; then go on.
inline void fiber_yield() {
    Block& b = block();
    Fiber& f = b.fibers[b.current];
    tsan_switch(b.tsan_scheduler);
    swapcontext(&f.context, &b.scheduler);
}

inline void barrier(int kind, int predicate, int* result) {
    Block& b = block();
    Fiber& f = b.fibers[b.current];
    f.waiting = true;
    f.kind = kind;
    f.predicate = predicate;
    f.result = result;
    tsan_switch(b.tsan_scheduler);
    swapcontext(&f.context, &b.scheduler);
}

// Run one block of `threads` fibers, each calling body(params), to the end.
inline void run_block(void (*body)(void**), void** params, unsigned threads) {
    Block& b = block();
    b.body = body;
    b.params = params;
    b.tsan_scheduler = tsan_current();
    if (b.fibers.size() < threads) b.fibers.resize(threads);
    for (unsigned t = 0; t < threads; ++t) {
        Fiber& f = b.fibers[t];
        f.done = f.waiting = false;
        if (f.stack.size() != STACK_BYTES) f.stack.resize(STACK_BYTES);
        tsan_destroy(f.tsan);  // a fresh TSan fiber per run: the last one's entry frame never left
        f.tsan = tsan_create();
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = f.stack.data();
        f.context.uc_stack.ss_size = f.stack.size();
        f.context.uc_link = &b.scheduler;
        makecontext(&f.context, fiber_entry, 0);
    }
    Here& h = here();
    for (;;) {
        // Run every live thread until it ends, reaches a barrier or yields (polling a flag).
        for (unsigned t = 0; t < threads; ++t) {
            Fiber& f = b.fibers[t];
            if (f.done || f.waiting) continue;
            b.current = (int)t;
            h.thread = uint3{t, 0, 0};
            tsan_switch(f.tsan);
            swapcontext(&b.scheduler, &f.context);
        }
        // Once every live thread waits at a barrier (threads that ended count as arrived, as on a
        // GPU from sm_70), release it, with the OR of the predicates; a thread that yielded runs on.
        bool yielded = false;
        for (unsigned t = 0; t < threads; ++t) yielded |= !b.fibers[t].done && !b.fibers[t].waiting;
        if (yielded) continue;
        int any = 0, kind = -1;
        unsigned waiting = 0;
        for (unsigned t = 0; t < threads; ++t) {
            const Fiber& f = b.fibers[t];
            if (f.done) continue;
            ++waiting;
            any |= f.predicate;
            if (kind == -1) kind = f.kind;
            if (f.kind != kind) {
                h.thread = uint3{t, 0, 0};
                trap("threads of one block wait at different barriers (__syncthreads and __syncthreads_or)");
            }
        }
        if (waiting == 0) return;
        for (unsigned t = 0; t < threads; ++t) {
            Fiber& f = b.fibers[t];
            if (f.done) continue;
            f.waiting = false;
            if (f.result) *f.result = any;
        }
    }
}

// The launch of kernels[index]: every block in the seeded order, every thread.
inline void run_launch(const char* kernel, void (*body)(void**), unsigned grid, unsigned threads, void** params,
                       unsigned long long seed) {
    std::vector<unsigned> order(grid);
    for (unsigned i = 0; i < grid; ++i) order[i] = i;
    // The order depends on the seed and the grid alone: every rank draws the same one.
    std::mt19937_64 draw(seed * 0x9e3779b97f4a7c15ull + grid);
    for (unsigned i = grid; i > 1; --i) std::swap(order[i - 1], order[draw() % i]);
    Here& h = here();
    h.kernel = kernel;
    h.seed = seed;
    h.grid_dim = uint3{grid, 1, 1};
    h.block_dim = uint3{threads, 1, 1};
    for (unsigned i = 0; i < grid; ++i) {
        h.block = uint3{order[i], 0, 0};
        run_block(body, params, threads);
    }
}

// kernel(*(A0*)params[0], *(A1*)params[1], ...): cuLaunchKernel's kernelParams.
template <class... A, size_t... I>
inline void invoke_with(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(params[I])...);
}

template <class... A> constexpr size_t arity(void (*)(A...)) { return sizeof...(A); }

template <auto Kernel> void call(void** params) {
    invoke_with(Kernel, params, std::make_index_sequence<arity(Kernel)>{});
}

struct Entry {
    const char* name;
    void (*body)(void**);
};

// gpucomm_host_launch's body, over the file's table of kernels.
inline int launch(const Entry* entries, size_t count, const char* kernel, unsigned grid, unsigned threads,
                  void** params, unsigned long long seed) {
    for (size_t i = 0; i < count; ++i) {
        if (std::strcmp(entries[i].name, kernel) == 0) {
            if (grid == 0 || threads == 0) return 2;
            run_launch(entries[i].name, entries[i].body, grid, threads, params, seed);
            return 0;
        }
    }
    return 1;
}

}  // namespace gpucomm_host

// The launch ABI of a host-built file: run the whole launch of `kernel` synchronously; params[i]
// points at parameter i (cuLaunchKernel's kernelParams). 0, or non-zero for an unknown kernel.
#define GPUCOMM_HOST_KERNELS(...)                                                                           \
    static const ::gpucomm_host::Entry gpucomm_host_entries[] = {__VA_ARGS__};                              \
    extern "C" __attribute__((visibility("default"))) int gpucomm_host_launch(                              \
        const char* kernel, unsigned grid_x, unsigned block_x, void** params, unsigned long long seed) {     \
        return ::gpucomm_host::launch(gpucomm_host_entries, sizeof gpucomm_host_entries / sizeof *gpucomm_host_entries, \
                                      kernel, grid_x, block_x, params, seed);                               \
    }
#define GPUCOMM_HOST_KERNEL(name) ::gpucomm_host::Entry{#name, &::gpucomm_host::call<&name>}
