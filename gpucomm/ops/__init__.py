"""The kernel contract and its implementations (torch reference, Triton, CUDA C++)."""

from gpucomm.ops.contract import SUPPORTED_DTYPES, Kernels, Region
from gpucomm.ops.registry import get_kernels

__all__ = ["Kernels", "Region", "SUPPORTED_DTYPES", "get_kernels"]
