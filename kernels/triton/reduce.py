"""Fused K-ary reduce: ``out = op(src0, src1, ..., src{K-1})``, each region a raw address.

The sources are folded left to right in table order, in the accumulation type (fp32 for 16-bit
floats), and rounded once at the store, so every rank that passes the same table order gets the
same bits. Addresses may point at peers' memory (CUDA IPC, POSIX shared memory).
"""

import torch
import triton
import triton.language as tl

from gpucomm._kernels.triton._common import OP_AVG, combine, divide, load_acc, store_rounded
from gpucomm._kernels.triton.types import TL_DTYPES

__all__ = ["reduce_kernel", "reduce"]


@triton.jit(do_not_specialize=["divisor"])
def reduce_kernel(
    addr_ptr,  # int64[K + 1]: [out address, src0 address, ..., src{K-1} address]
    n_elements,  # elements in out and in every source
    divisor,  # AVG divides the sum by this once; unused by the other ops
    DTYPE: tl.constexpr,  # element type of out and the sources
    OP: tl.constexpr,  # a gpucomm.ReduceOp value (gpucomm.ops.instruction_set's OP_*)
    K: tl.constexpr,  # number of sources
    ALIGNED: tl.constexpr,  # every address is a multiple of 16 bytes (allows vector accesses)
    BLOCK: tl.constexpr,  # elements per program
):
    # int64 offsets: a slot can hold more than 2**31 elements.
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    acc = load_acc(tl.load(addr_ptr + 1), offs, mask, DTYPE, ALIGNED)
    for k in tl.static_range(1, K):
        acc = combine(acc, load_acc(tl.load(addr_ptr + 1 + k), offs, mask, DTYPE, ALIGNED), OP)
    if OP == OP_AVG:
        acc = divide(acc, divisor)
    # Every source is read before out is written, so out may alias a source at the same offset.
    store_rounded(tl.load(addr_ptr), offs, acc, mask, DTYPE, ALIGNED)


def reduce(
    addrs: torch.Tensor,
    n_elements: int,
    dtype: torch.dtype,
    op: int,
    divisor: int,
    aligned: bool,
    block: int = 1024,
) -> None:
    """Launch ``reduce_kernel`` on ``addrs`` = [out, src0, ...] (int64, on the data's device).

    ``aligned`` promises that every address in ``addrs`` is a multiple of 16 bytes.
    """
    if addrs.dtype != torch.int64 or addrs.dim() != 1 or addrs.numel() < 2:
        raise ValueError(
            f"reduce: addrs must be a 1-D int64 tensor [out, src0, ...], got {addrs.dtype} of shape "
            f"{tuple(addrs.shape)}"
        )
    if dtype not in TL_DTYPES:
        raise TypeError(f"reduce: dtype must be one of {list(TL_DTYPES)}, got {dtype}")
    if n_elements == 0:
        return
    grid = (triton.cdiv(n_elements, block),)
    reduce_kernel[grid](
        addrs,
        n_elements,
        divisor,
        DTYPE=TL_DTYPES[dtype],
        OP=op,
        K=addrs.numel() - 1,
        ALIGNED=aligned,
        BLOCK=block,
    )
