"""The host build of the CUDA C++ kernels (gpucomm.ops.cuda_host, kernels/cuda/host_shim.h): the
launch ABI, the traps, the knobs, and that kernels=cuda on CPU tensors stays an error without
GPUCOMM_CUDA_EMULATE=1.

The kernels' numerics are tests/ops/test_cpu_kernels.py's (impl "cuda"); the collectives on them
tests/workspace/test_workspace_collectives.py's, test_small_allreduce.py's and test_cuda_emulation.py's.
"""

from __future__ import annotations

import ctypes
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

from gpucomm.config import CudaEmulation, _cuda_emulation
from gpucomm.errors import UnsupportedError
from gpucomm.ops import cuda_host, get_kernels
from gpucomm.ops.cuda_source import SOURCES
from gpucomm.ops.launcher import Param

DEFINES = {"GPUCOMM_THREADS": 64}


def test_every_file_builds_and_names_its_kernels() -> None:
    for file in SOURCES:
        path = cuda_host.library(file, DEFINES)
        assert pathlib.Path(path).is_file()
        assert cuda_host.library(file, DEFINES) == path  # one build per (file, defines)
    assert cuda_host.kernel_names("copy.cu", DEFINES) == ["gpucomm_copy"]
    assert cuda_host.kernel_names("flags.cu", DEFINES) == ["gpucomm_signal", "gpucomm_wait"]
    assert len(cuda_host.kernel_names("program.cu", DEFINES)) == 4 * 6 + 1  # folds x dtypes, and copy
    assert len(cuda_host.kernel_names("small.cu", DEFINES)) == 5 * 6


def test_the_launch_abi_runs_a_grid_and_refuses_an_unknown_kernel() -> None:
    """cuLaunchKernel's kernelParams: params[i] points at parameter i."""
    launch = ctypes.CDLL(cuda_host.library("copy.cu", DEFINES)).gpucomm_host_launch
    launch.restype = ctypes.c_int
    src = torch.arange(5000, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    values = [ctypes.c_uint64(dst.data_ptr() + 3), ctypes.c_uint64(src.data_ptr() + 3), ctypes.c_uint64(19990)]
    params = (ctypes.c_void_p * 3)(*(ctypes.addressof(v) for v in values))
    assert launch(b"gpucomm_copy", ctypes.c_uint(3), ctypes.c_uint(64), params, ctypes.c_ulonglong(7)) == 0
    assert torch.equal(dst[3:19993], src[3:19993]) and dst[:3].eq(0).all() and dst[19993:].eq(0).all()
    assert launch(b"gpucomm_nothing", ctypes.c_uint(1), ctypes.c_uint(64), params, ctypes.c_ulonglong(0)) != 0


def test_a_misaligned_16_byte_access_traps() -> None:
    """A GPU faults on a misaligned vector access; the host build ends the process with a message."""
    folder = pathlib.Path(cuda_host.library("copy.cu", DEFINES)).parent
    source = folder / "misaligned_test.cpp"
    source.write_text(
        textwrap.dedent(
            """
            #include "host_shim.h"
            alignas(16) static unsigned char bytes[64];
            int main() {
                uint4 v = __ldcg((const uint4*)(bytes + 16));  // aligned: fine
                __stcg((uint4*)(bytes + 32), v);
                v = __ldcg((const uint4*)(bytes + 8));  // misaligned
                return (int)v.x;
            }
            """
        )
    )
    shim = pathlib.Path(cuda_host._source_dir())
    binary = folder / "misaligned_test"
    subprocess.run([cuda_host.compiler(), "-std=c++17", f"-I{shim}", str(source), "-o", str(binary)], check=True)
    done = subprocess.run([str(binary)], capture_output=True, text=True)
    source.unlink()
    binary.unlink()
    assert done.returncode != 0
    assert "misaligned 16-byte load" in done.stderr and "trap" in done.stderr, done.stderr


def _misaligned_small_launch() -> None:
    """small.cu's copy-in of a float32 tensor at an odd address: a 4-byte access a GPU would fault on."""
    from gpucomm.ops.cuda_emulate import EmulatedCudaKernels
    from gpucomm.ops.launch_args import SmallArgs
    from gpucomm.reduce_op import ReduceOp

    half = torch.zeros(4096, dtype=torch.uint8)
    flags = torch.zeros(64, dtype=torch.int64)
    state = torch.zeros(8, dtype=torch.int64)
    record = torch.zeros(8, dtype=torch.int64)
    x = torch.zeros(64, dtype=torch.uint8)
    args = SmallArgs(
        x=x.data_ptr() + 1,
        n=5,
        stages=(half.data_ptr(),),
        flags=(flags.data_ptr(),),
        half_bytes=2048,
        state_addr=state.data_ptr(),
        record_addr=record.data_ptr(),
        rank=0,
        fingerprint=1,
        timeout_ns=10**9,
        channels=1,
        all_channels=1,
        divisor=1,
        dtype=torch.float32,
        op=ReduceOp.SUM,
    )
    EmulatedCudaKernels(threads=64, seed=12345).prepare_small(args)()


def test_a_kernel_fault_names_the_kernel_block_thread_and_seed() -> None:
    code = "import sys; sys.path.insert(0, sys.argv[1]); import test_cuda_host as t; t._misaligned_small_launch()"
    done = subprocess.run(
        [sys.executable, "-c", code, str(pathlib.Path(__file__).parent)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "misaligned 4-byte load" in done.stderr, done.stderr
    assert "gpucomm_small_sum_float32, block 0 thread 0" in done.stderr and "seed 12345" in done.stderr, done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_kernels_cuda_on_cpu_stays_an_error_without_the_switch() -> None:
    """This pytest process has no GPUCOMM_CUDA_EMULATE (conftest leaves it unset)."""
    with pytest.raises(UnsupportedError, match="GPUCOMM_CUDA_EMULATE=1"):
        get_kernels("cuda", "cpu")


def test_the_switch_and_its_knobs() -> None:
    assert _cuda_emulation({}) == CudaEmulation(False, 512, 0)
    assert _cuda_emulation({"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64"}) == CudaEmulation(
        True, 64, 0
    )
    assert _cuda_emulation({"GPUCOMM_CUDA_EMULATE_SEED": "99"}).seed == 99
    for bad in ({"GPUCOMM_CUDA_EMULATE": "yes"}, {"GPUCOMM_CUDA_EMULATE_THREADS": "32"}):
        with pytest.raises(ValueError, match="GPUCOMM_CUDA_EMULATE"):
            _cuda_emulation(bad)


def test_a_grid_of_blocks_in_any_order_gives_the_same_bits() -> None:
    """reduce.cu over 4 blocks, several block orders: every element is one thread's."""
    from gpucomm.ops.cuda_emulate import EmulatedCudaKernels
    from gpucomm.ops.cuda_params import REDUCE_PARAMS

    gen = torch.Generator().manual_seed(5)
    srcs = [torch.randn(4 * 64 * 4 + 3, generator=gen) for _ in range(3)]
    table = torch.tensor([s.data_ptr() for s in srcs], dtype=torch.int64)
    outs = []
    for seed in range(4):
        out = torch.full_like(srcs[0], float("nan"))
        values = (out.data_ptr(), table.data_ptr(), 3, out.numel(), 1)
        params = [Param(name, size, v) for (name, size), v in zip(REDUCE_PARAMS, values)]
        path = EmulatedCudaKernels(threads=64).library("reduce.cu")
        cuda_host.HostLaunch(path, "gpucomm_reduce_sum_float32", 4, 64, params, seed)()
        outs.append(out)
    want = (srcs[0] + srcs[1]) + srcs[2]
    for out in outs:
        assert torch.equal(out, want)
