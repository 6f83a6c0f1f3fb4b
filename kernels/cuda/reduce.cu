// Fused n-ary reduce: out[i] = op(srcs[0][i], ..., srcs[k-1][i]), folded left to right in table
// order (see gpucomm::reduce_grid in common.cuh for the numerics).
//
// One kernel per op x dtype, named gpucomm_reduce_<op>_<dtype>, e.g. gpucomm_reduce_sum_float32:
//   out      destination (local or peer address)
//   srcs     device table of k source addresses (int64 tensor on the host side)
//   k        number of sources, >= 1
//   n        elements per source
//   divisor  AVG's divisor (ignored by the other ops)

#include "common.cuh"

#define GPUCOMM_REDUCE_KERNEL(op_name, OpType, dtype_name, DType)                              \
    extern "C" __global__ void __launch_bounds__(GPUCOMM_THREADS)                              \
        gpucomm_reduce_##op_name##_##dtype_name(void* out, const gc_u64* srcs, int k, gc_u64 n, \
                                                gc_i64 divisor) {                              \
        gpucomm::reduce_grid<DType, OpType>(out, srcs, k, n, divisor);                         \
    }

GPUCOMM_FOR_EACH_OP_AND_DTYPE(GPUCOMM_REDUCE_KERNEL)
