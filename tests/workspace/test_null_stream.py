"""The NULL stream stays the NULL stream: a launch on the caller's default stream reaches the
driver (or CuPy, or Triton's launcher) with stream handle 0, through every launch path.

Why: wrapping the handle as ``torch.cuda.ExternalStream(handle)`` loses it. For handle 0 torch does
not wrap the NULL stream:
it hands out a new non-blocking stream from its pool (pytorch issue #182960), which nothing orders
against the default stream, so those kernels ran unordered against the work around them. On the
default stream, torch's raw current-stream handle (``torch._C._cuda_getCurrentRawStream``, what
``CudaKernels`` and the device executor read) is 0; these tests hand each path that 0 and check
what arrives where the launch leaves gpucomm. No GPU: the driver double records the stream of each
``cuLaunchKernel``; stand-ins for CuPy's Function and Triton's compiled kernel record theirs.
"""

from __future__ import annotations

import time
import types

import cuda_double
import pytest
import torch

from gpucomm.ops.launch_args import ProgramArgs
from gpucomm.toolchain import native

NULL_STREAM = 0

needs_launcher = pytest.mark.skipif(
    native.load("launch") is None, reason="gpucomm's launcher cannot be built here (no C compiler)"
)


def _every_kernel(kernels, regions) -> None:  # noqa: ANN001
    """One call of each CudaKernels launch on the default stream: copy, reduce, signal, wait and
    the program kernel."""
    import torch

    from gpucomm.reduce_op import ReduceOp

    out, a, flag = regions
    kernels.copy(out, a)
    kernels.reduce(out, [a, out], torch.float32, ReduceOp.SUM)
    kernels.signal([flag], 5)
    kernels.wait([flag], 5, time.monotonic() + 5.0)
    prog, operands, peers = (
        torch.zeros(16, dtype=torch.int64),
        torch.zeros(6, dtype=torch.int64),
        torch.zeros(4, dtype=torch.int64),
    )
    kernels.run_program(
        ProgramArgs(
            prog,
            operands,
            peers,
            0x7F00_0000_1000,
            0x7F00_0000_2000,
            channels=2,
            rank=0,
            world=2,
            fingerprint=1,
            half_bytes=1 << 20,
            granule=4096,
            timeout_ns=10**9,
            dtype=torch.float32,
            op=0,
            copy_bytes=16,
            aligned=True,
        )
    )


def _regions():  # noqa: ANN202
    import torch
    from cuda_kernels_double import OnTheGpu

    from gpucomm.ops.contract import Region

    OnTheGpu.device = torch.device("cuda", 0)
    return (
        Region(0x7F00_0001_0000, 4096, OnTheGpu()),
        Region(0x7F00_0002_0000, 4096, OnTheGpu()),
        Region(0x7F00_0100_0000, 8, OnTheGpu()),
    )


@needs_launcher
def test_cuda_kernels_launches_on_the_null_stream_reach_the_driver_as_0(nvcc_fatbins, tmp_path) -> None:
    from cuda_kernels_double import cuda_kernels_on_the_double

    double = cuda_double.build()
    kernels = cuda_kernels_on_the_double(nvcc_fatbins, double, 90)
    kernels._raw_stream = lambda: NULL_STREAM
    cuda_double.log_to(double, tmp_path / "calls.log")
    try:
        _every_kernel(kernels, _regions())
    finally:
        cuda_double.log_to(double, None)
    launches = cuda_double.records(tmp_path / "calls.log", "cuLaunchKernel")
    assert [r["name"] for r in launches] == [
        "gpucomm_copy",
        "gpucomm_reduce_sum_float32",
        "gpucomm_signal",
        "gpucomm_wait",
        "gpucomm_program_sum_float32",
    ]
    assert {r["stream"] for r in launches} == {"0"}


def test_cupys_launches_on_the_null_stream_get_handle_0(nvcc_fatbins) -> None:
    """Where the launcher cannot be built, CuPy's Function launches: the stream it gets has ``.ptr``
    0, and is not a stream object of torch's (no pool stream stands in for the NULL stream)."""
    import torch
    from cuda_kernels_double import RecordingCupy, cuda_kernels_on_the_double

    from gpucomm.ops.cuda_ops import program_kernel_name, reduce_kernel_name
    from gpucomm.reduce_op import ReduceOp

    kernels = cuda_kernels_on_the_double(nvcc_fatbins, cuda_double.build(), 90)
    kernels._driver, kernels._cupy = None, RecordingCupy()
    kernels._raw_stream = lambda: NULL_STREAM
    for file, name in (
        ("copy.cu", "gpucomm_copy"),
        ("reduce.cu", reduce_kernel_name(torch.float32, ReduceOp.SUM)),
        ("flags.cu", "gpucomm_signal"),
        ("flags.cu", "gpucomm_wait"),
        ("program.cu", program_kernel_name(torch.float32, ReduceOp.SUM)),
    ):
        kernels._functions[(file, name)] = kernels._cupy.function(name)
    _every_kernel(kernels, _regions())
    calls = kernels._cupy.calls
    assert [c[0] for c in calls] == [
        "gpucomm_copy",
        "gpucomm_reduce_sum_float32",
        "gpucomm_signal",
        "gpucomm_wait",
        "gpucomm_program_sum_float32",
    ]
    assert [c[4] for c in calls] == [NULL_STREAM] * len(calls)


class _CompiledKernel:
    """What gpucomm reads of a Triton compiled kernel (``CachedKernel``'s shape): a kernel of two
    parameters, an fp32 pointer and an i32; ``run`` records the stream its launcher is handed."""

    def __init__(self) -> None:
        self.asm = {"cubin": b".entry null_stream_k(\n\0"}
        self.metadata = types.SimpleNamespace(name="null_stream_k", num_warps=4, warp_size=32, shared=0)
        self.src = types.SimpleNamespace(signature={"x_ptr": "*fp32", "n": "i32"}, constants={})
        self.hash = "null-stream-test"
        self.function, self.packed_metadata = 0x1234, None
        self.streams: list[int] = []

    def run(self, gx: int, gy: int, gz: int, stream: int, *rest: object) -> None:
        self.streams.append(stream)


@needs_launcher
def test_a_bound_triton_launch_on_the_null_stream_reaches_the_driver_as_0(tmp_path) -> None:
    from gpucomm.ops import launcher, triton_launch

    double = cuda_double.build()
    drv = launcher.driver(double)
    cuda_double.log_to(double, tmp_path / "calls.log")
    try:
        bound = triton_launch.bind(
            _CompiledKernel(), drv, 0, (3,), {"x_ptr": 0x7F00_0000_4000, "n": 7}, stream=NULL_STREAM
        )
        bound.launch(NULL_STREAM)
        bound()  # on the stream given at bind
    finally:
        cuda_double.log_to(double, None)
    launches = cuda_double.records(tmp_path / "calls.log", "cuLaunchKernel")
    assert [(r["name"], r["stream"]) for r in launches] == [("null_stream_k", "0")] * 2


def test_tritons_own_launcher_gets_handle_0_where_gpucomms_cannot_be_built() -> None:
    from gpucomm.ops import triton_launch

    kernel = _CompiledKernel()
    triton_launch.CompiledLaunch(kernel, (3,), [0x7F00_0000_4000, 7], torch.device("cpu")).launch(NULL_STREAM)
    assert kernel.streams == [NULL_STREAM]
