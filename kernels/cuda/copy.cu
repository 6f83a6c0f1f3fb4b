// Vectorised byte copy: gpucomm_copy(dst, src, nbytes); either side may be a peer address.
// dst and src must not overlap.
//
// The widest word w (16, 8, 4, 2 or 1 bytes) that dst and src can both be aligned to at once is
// the largest power of two dividing (dst - src). The bytes before dst's first w-aligned address
// (the head) and after the last whole word (the tail) are copied one by one; the middle in
// w-byte words, grid-stride, COPY_WORDS_IN_FLIGHT loads of a thread at a time (common.cuh's
// copy_span, which program.cu's COPY runs too). Loads and stores are .cg: global space (the
// addresses arrive as integers, so plain accesses would be generic) and L2 only (data moved once).

#include "common.cuh"

namespace {

template <class W>
__device__ __forceinline__ void copy_words(char* dst, const char* src, gc_u64 nbytes) {
    const gc_u64 w = sizeof(W);
    gc_u64 head = (w - ((gc_u64)dst & (w - 1))) & (w - 1);
    if (head > nbytes) head = nbytes;
    const gc_u64 nwords = (nbytes - head) / w;
    const gc_u64 tail_start = head + nwords * w;
    const gc_u64 tid = gpucomm::global_thread();
    const gc_u64 stride = gpucomm::grid_threads();

    gpucomm::copy_span<W>((gc_u64)(dst + head), (gc_u64)(src + head), nwords, tid, stride);

    // Head bytes are r in [0, head); tail bytes follow from tail_start.
    const gc_u64 loose = head + (nbytes - tail_start);
    for (gc_u64 r = tid; r < loose; r += stride) {
        const gc_u64 i = r < head ? r : tail_start + (r - head);
        dst[i] = __ldcg(src + i);
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(GPUCOMM_THREADS)
    gpucomm_copy(void* dst, const void* src, gc_u64 nbytes) {
    char* d = (char*)dst;
    const char* s = (const char*)src;
    const gc_u64 skew = ((gc_u64)d ^ (gc_u64)s) & 15;
    if (skew == 0) {
        copy_words<uint4>(d, s, nbytes);
    } else if ((skew & 7) == 0) {
        copy_words<gc_u64>(d, s, nbytes);
    } else if ((skew & 3) == 0) {
        copy_words<unsigned int>(d, s, nbytes);
    } else if ((skew & 1) == 0) {
        copy_words<unsigned short>(d, s, nbytes);
    } else {
        copy_words<unsigned char>(d, s, nbytes);
    }
}
