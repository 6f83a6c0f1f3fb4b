// Flag kernels of the epoch protocol (docs/cuda-kernels.md). Launch each with one block.

#include "common.cuh"

// Store epoch into every flag of the table with release semantics at system scope.
//   flag_addrs  device table of n flag addresses (local or peer)
// The kernel runs after this rank's earlier kernels in stream order; the system-scope fence
// makes their writes (to local or peer memory) visible before any flag changes.
extern "C" __global__ void __launch_bounds__(GPUCOMM_THREADS)
    gpucomm_signal(const gc_u64* flag_addrs, int n, gc_i64 epoch) {
    __threadfence_system();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        gpucomm::store_release_sys((gc_i64*)flag_addrs[i], epoch);
    }
}

// Acquire-load every flag until each is >= epoch or timeout_ns passed.
//   status  error record, host-initialised to {0, epoch, ...}: status[0] = 1 on a timeout and
//           status[1 + i] = the value seen of every flag i that did not arrive.
extern "C" __global__ void __launch_bounds__(GPUCOMM_THREADS)
    gpucomm_wait(const gc_u64* flag_addrs, int n, gc_i64 epoch, gc_u64 timeout_ns,
                 gc_i64* status) {
    gpucomm::wait_flags_block(flag_addrs, n, epoch, timeout_ns, status);
}
