// Fused one-shot all-reduce step: wait for the peers' flags, then reduce their slots into out.
//
// One kernel per op x dtype, named gpucomm_oneshot_allreduce_<op>_<dtype>:
//   out, srcs, k, n, divisor   as in reduce.cu (srcs: the P peer slots, in rank order)
//   flag_addrs, nflags         device table of the flags to wait on
//   epoch                      the value every flag must reach
//   timeout_ns                 how long each block may wait
//   status                     error record, host-initialised to {0, epoch, ...}: see
//                              gpucomm::wait_flags_block in common.cuh
//
// Every block waits on the flags itself (blocks of one launch never wait on each other); a block
// whose wait times out writes the error record and reduces nothing, so out is only partly written
// on a timeout and the host raises.

#include "common.cuh"

#define GPUCOMM_ONESHOT_KERNEL(op_name, OpType, dtype_name, DType)                               \
    extern "C" __global__ void __launch_bounds__(GPUCOMM_THREADS)                                \
        gpucomm_oneshot_allreduce_##op_name##_##dtype_name(                                      \
            void* out, const gc_u64* srcs, int k, gc_u64 n, gc_i64 divisor,                      \
            const gc_u64* flag_addrs, int nflags, gc_i64 epoch, gc_u64 timeout_ns,               \
            gc_i64* status) {                                                                    \
        if (!gpucomm::wait_flags_block(flag_addrs, nflags, epoch, timeout_ns, status)) return;   \
        gpucomm::reduce_grid<DType, OpType>(out, srcs, k, n, divisor);                           \
    }

GPUCOMM_FOR_EACH_OP_AND_DTYPE(GPUCOMM_ONESHOT_KERNEL)
