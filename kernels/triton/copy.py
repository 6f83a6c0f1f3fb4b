"""Byte copy between two raw addresses, in the widest element both addresses and the size allow.

Either address may be a peer's memory (CUDA IPC, POSIX shared memory).
"""

import torch
import triton
import triton.language as tl

from gpucomm._kernels.triton._common import as_pointer
from gpucomm._kernels.triton.types import COPY_ELEMS

__all__ = ["copy_kernel", "copy", "element_bytes"]


@triton.jit
def copy_kernel(
    addr_ptr,  # int64[2]: [dst address, src address]
    n_elements,  # number of ELEM elements to copy
    ELEM: tl.constexpr,  # element type moved per lane (int64, int32, int16 or uint8)
    ALIGNED: tl.constexpr,  # both addresses are multiples of 16 bytes (allows vector accesses)
    BLOCK: tl.constexpr,  # elements per program
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    dst = as_pointer(tl.load(addr_ptr), ELEM, ALIGNED)
    src = as_pointer(tl.load(addr_ptr + 1), ELEM, ALIGNED)
    # src may be a peer's: .cg, as every peer load (docs/kernel-contract.md, "One memory contract").
    tl.store(dst + offs, tl.load(src + offs, mask=mask, cache_modifier=".cg"), mask=mask)


def element_bytes(dst_addr: int, src_addr: int, nbytes: int) -> int:
    """The widest element size (8, 4, 2 or 1) dividing both addresses and the size."""
    common = dst_addr | src_addr | nbytes
    return next(size for size in (8, 4, 2, 1) if common % size == 0)


def copy(addrs: torch.Tensor, elem_bytes: int, nbytes: int, aligned: bool, block: int = 2048) -> None:
    """Launch ``copy_kernel``: ``nbytes`` bytes from ``addrs[1]`` to ``addrs[0]`` in ``elem_bytes`` units.

    ``aligned`` promises that both addresses are multiples of 16 bytes.
    """
    if addrs.dtype != torch.int64 or addrs.shape != (2,):
        raise ValueError(f"copy: addrs must be int64 [dst, src], got {addrs.dtype} of shape {tuple(addrs.shape)}")
    if elem_bytes not in COPY_ELEMS or nbytes % elem_bytes:
        raise ValueError(f"copy: elem_bytes must be 8, 4, 2 or 1 and divide nbytes={nbytes}, got {elem_bytes}")
    n_elements = nbytes // elem_bytes
    if n_elements == 0:
        return
    copy_kernel[(triton.cdiv(n_elements, block),)](
        addrs, n_elements, ELEM=COPY_ELEMS[elem_bytes], ALIGNED=aligned, BLOCK=block
    )
