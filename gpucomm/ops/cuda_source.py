"""The CUDA C++ kernels' sources (``kernels/cuda``) and their compilation by NVRTC.

:func:`compile_source` compiles one file with :func:`compile_options` (the options CI also hands
to nvcc: tests/ops/test_cuda_compile.py) into a cubin, or PTX for a GPU newer than NVRTC knows
(:func:`target`); the ``*_kernel_name`` functions name the ``extern "C"`` kernel of a dtype and op.

NVRTC is driven through CuPy's thin binding (``cupy_backends.cuda.libs.nvrtc``) rather than
``cupy.RawModule``: RawModule appends ``-ftz=true`` after the caller's options, and flushing
subnormals to zero would break the bitwise agreement with the torch reference (bf16 and fp32
subnormals).
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gpucomm.errors import KernelCompileError, UnsupportedError
from gpucomm.ops import instruction_set
from gpucomm.ops.contract import SUPPORTED_DTYPES
from gpucomm.reduce_op import ReduceOp

__all__ = [
    "KERNEL_PACKAGE",
    "SOURCES",
    "HEADER",
    "THREADS",
    "DEFINES",
    "compile_options",
    "compile_source",
    "kernel_source",
    "target",
    "unsupported",
    "program_kernel_name",
    "reduce_kernel_name",
    "small_kernel_name",
]

KERNEL_PACKAGE = "gpucomm._kernels.cuda"
SOURCES = ("copy.cu", "reduce.cu", "flags.cu", "program.cu", "small.cu")
HEADER = "common.cuh"

# Threads per block of every launch, passed to the sources as -DGPUCOMM_THREADS (their
# __launch_bounds__). 512 keeps enough loads in flight per SM for copies and reduces.
THREADS = 512
DEFINES = {"GPUCOMM_THREADS": THREADS}

_OP_NAMES = {
    ReduceOp.SUM: "sum",
    ReduceOp.PRODUCT: "prod",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.AVG: "avg",
}
_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES}


def reduce_kernel_name(dtype: torch.dtype, op: ReduceOp) -> str:
    """The ``extern "C"`` name of the reduce kernel for dtype × op."""
    return f"gpucomm_reduce_{_OP_NAMES[op]}_{_DTYPE_NAMES[dtype]}"


def program_kernel_name(dtype: torch.dtype | None, op: ReduceOp) -> str:
    """The ``extern "C"`` name of the program kernel for a program's dtype and fold (one of
    PROGRAM_FOLDS); ``dtype`` None (a program without REDUCE) names the copy-only kernel."""
    if dtype is None:
        return "gpucomm_program_copy"
    return f"gpucomm_program_{_OP_NAMES[op]}_{_DTYPE_NAMES[dtype]}"


def small_kernel_name(dtype: torch.dtype, op: ReduceOp) -> str:
    """The ``extern "C"`` name of small.cu's kernel for dtype × op (one of SMALL_OPS)."""
    return f"gpucomm_small_{_OP_NAMES[op]}_{_DTYPE_NAMES[dtype]}"


def compile_options(arch: str, defines: Mapping[str, object]) -> tuple[str, ...]:
    """The compiler options of every kernel file, valid for NVRTC and nvcc alike: the
    instruction set's defines (:func:`gpucomm.ops.instruction_set.cuda_defines`), then
    ``defines``, each as ``-DNAME=value`` in sorted order.

    ``arch`` is ``sm_XY`` (a cubin) or ``compute_XY`` (PTX). Rounding is pinned so that results
    match the torch reference bitwise: no FMA contraction, no flush to zero, IEEE division. The
    instruction set is a constant of the package, so the memo key of an image (its ``defines``)
    needs no part of it.
    """
    return (
        "-std=c++17",
        f"--gpu-architecture={arch}",
        "--fmad=false",
        "-ftz=false",
        "-prec-div=true",
        "-prec-sqrt=true",
        *(f"-D{name}={value}" for name, value in sorted(instruction_set.cuda_defines().items())),
        *(f"-D{name}={value}" for name, value in sorted(defines.items())),
    )


def kernel_source(name: str) -> str:
    """The text of one file of ``kernels/cuda`` as shipped in the package."""
    return importlib.resources.files(KERNEL_PACKAGE).joinpath(name).read_text(encoding="utf-8")


def compile_source(nvrtc: Any, file: str, arch: str, binary_kind: str, defines: Mapping[str, object]) -> bytes:
    """``file`` of ``kernels/cuda`` compiled by NVRTC (CuPy's binding ``nvrtc``) for ``arch``:
    a cubin if ``binary_kind`` is ``"cubin"``, else NUL-terminated PTX.

    Raises:
        KernelCompileError: NVRTC rejected the source; the message holds its log.
    """
    options = compile_options(arch, defines)
    program = nvrtc.createProgram(kernel_source(file), file, [kernel_source(HEADER).encode()], [HEADER.encode()])
    try:
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            raise KernelCompileError(
                f"gpucomm: NVRTC failed to compile kernels/cuda/{file} with {' '.join(options)}:\n"
                f"{nvrtc.getProgramLog(program)}"
            ) from exc
        if binary_kind == "cubin":
            return nvrtc.getCUBIN(program)
        # cuModuleLoadData reads PTX as a NUL-terminated string; getPTX strips the NUL.
        return nvrtc.getPTX(program) + b"\0"
    finally:
        nvrtc.destroyProgram(program)


def unsupported(reason: str) -> UnsupportedError:
    return UnsupportedError(f"gpucomm: GPUCOMM_KERNELS=cuda needs a CUDA device and CuPy with NVRTC: {reason}")


def target(capability: tuple[int, int], supported: Sequence[int]) -> tuple[str, str]:
    """(arch option, binary kind) for a device: a cubin where NVRTC knows the GPU, else PTX of the
    newest architecture it knows below it (the driver JIT-compiles PTX for newer GPUs)."""
    cc = capability[0] * 10 + capability[1]
    if cc in supported:
        return f"sm_{cc}", "cubin"
    older = [a for a in supported if a <= cc]
    if not older:
        raise unsupported(f"NVRTC supports {sorted(supported)}, none at or below this device's sm_{cc}")
    return f"compute_{max(older)}", "ptx"
