"""The Triton types of gpucomm's kernels: the one map from torch dtypes to Triton's, and the
integer type a copy of a given width moves.

Every launcher in ``kernels/triton`` and :mod:`gpucomm.ops.triton_ops` looks dtypes up here, so
a dtype the kernels learn is added once.
"""

import torch
import triton.language as tl

__all__ = ["TL_DTYPES", "COPY_ELEMS"]

# The element types the kernels reduce (gpucomm.ops.contract.SUPPORTED_DTYPES) and move.
TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float64: tl.float64,
    torch.int32: tl.int32,
    torch.int64: tl.int64,
}

# The integer type of each width in bytes: copies move bits, never values.
COPY_ELEMS = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.uint8}
