"""A kernel is compiled and loaded before what depends on it: a function gpucomm's launcher hands
out is loaded whole (never at its first launch, which under lazy loading can wait behind a kernel
spinning on a flag), and the CUDA wait kernel's time limit is taken after its first compile. No
GPU: the driver double models lazy loading (tests/support/cuda_double/module.c) and records each launch's
``loaded=`` (whether its function was loaded before it)."""

from __future__ import annotations

import ctypes
import time

import cuda_double
from cuda_kernels_double import OnTheGpu, cuda_kernels_on_the_double
from launcher_double import NEEDS_LAUNCHER, double_fixture, log_fixture  # noqa: F401 (fixtures double, log)
from ptx_params import entry_params, run_ptx

from gpucomm.ops import launcher
from gpucomm.ops.launcher import Param

pytestmark = NEEDS_LAUNCHER

IMAGE = b".entry lazy_k(\n.entry raw_k(\n\0"


def test_the_double_loads_a_function_at_its_first_launch_unless_it_was_loaded(double, log) -> None:
    """The double's lazy loading, reached without gpucomm's launcher: a function from
    cuModuleGetFunction is launched unloaded, and loaded from then on (what the test below tells
    apart)."""
    drv = launcher.driver(double)  # initialises the driver
    lib = ctypes.CDLL(double)
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(IMAGE)) == 0
    assert lib.cuModuleGetFunction(ctypes.byref(function), module, b"raw_k") == 0
    state = ctypes.c_int(-1)
    assert lib.cuFuncIsLoaded(ctypes.byref(state), function) == 0 and state.value == 0
    bound = launcher.bind(drv, function.value, [Param("a", 8, 1)], grid=(1, 1, 1), block=(32, 1, 1))
    bound.launch(0)
    bound.launch(0)
    assert [r["loaded"] for r in cuda_double.records(log, "cuLaunchKernel")] == ["0", "1"]


def test_a_function_the_launcher_hands_out_is_loaded_before_its_first_launch(double, log) -> None:
    drv = launcher.driver(double)
    function = drv.load(IMAGE, "lazy_k", 0)
    calls = cuda_double.records(log)
    (got,) = [i for i, c in enumerate(calls) if c.entry == "cuModuleGetFunction" and c["name"] == "lazy_k"]
    loads = [c for c in calls[got:] if c.entry == "cuFuncLoad"]
    assert [(c["name"], int(c["function"], 16)) for c in loads] == [("lazy_k", function)]
    launcher.bind(drv, function, [Param("a", 8, 7)], grid=(1, 1, 1), block=(32, 1, 1)).launch(0x10)
    (launch,) = cuda_double.records(log, "cuLaunchKernel")
    assert launch["loaded"] == "1"


def test_cuda_kernels_first_launches_find_their_functions_loaded(nvcc_fatbins, double, log) -> None:
    """CudaKernels' first copy, reduce, signal and wait each launch a function already loaded."""
    import torch

    from gpucomm.ops.contract import Region
    from gpucomm.reduce_op import ReduceOp

    OnTheGpu.device = torch.device("cuda", 0)
    kernels = cuda_kernels_on_the_double(nvcc_fatbins, double, 90)
    out, a = Region(0x7F00_0001_0000, 4096, OnTheGpu()), Region(0x7F00_0002_0000, 4096, OnTheGpu())
    flags = [Region(0x7F00_0100_0000, 8, OnTheGpu())]
    kernels.copy(out, a)
    kernels.reduce(out, [a, out], torch.float32, ReduceOp.SUM)
    kernels.signal(flags, 3)
    kernels.wait(flags, 3, time.monotonic() + 5.0)
    launches = cuda_double.records(log, "cuLaunchKernel")
    assert [(r["name"], r["loaded"]) for r in launches] == [
        ("gpucomm_copy", "1"),
        ("gpucomm_reduce_sum_float32", "1"),
        ("gpucomm_signal", "1"),
        ("gpucomm_wait", "1"),
    ]


def test_the_wait_kernels_time_limit_is_taken_after_its_first_compile(nvcc_fatbins, double, log) -> None:
    """A first wait compiles flags.cu (NVRTC, seconds on a GPU host): the limit the kernel gets is
    what is left of the deadline after that compile, not before it."""
    import torch

    from gpucomm.ops.contract import Region

    OnTheGpu.device = torch.device("cuda", 0)
    kernels = cuda_kernels_on_the_double(nvcc_fatbins, double, 90)
    compiled = {key: image for key, image in kernels._images.items() if key[0] == "flags.cu"}
    for key in compiled:
        del kernels._images[key]
    compiled_at = []
    compile_s = 0.5  # long beside the time the rest of the call takes on the 2-core CI machine (well under 0.1 s)

    def slow_compile(file: str, defines: object) -> bytes:
        time.sleep(compile_s)
        compiled_at.append(time.monotonic())
        (image,) = [image for key, image in compiled.items() if key[0] == file]
        return image

    kernels._compile = slow_compile
    deadline = time.monotonic() + 2.0
    kernels.wait([Region(0x7F00_0100_0000, 8, OnTheGpu())], 1, deadline)
    (launch,) = cuda_double.records(log, "cuLaunchKernel")
    declared = entry_params(run_ptx(nvcc_fatbins, "flags.cu", 90), "gpucomm_wait")
    offset, size = declared[3]  # timeout_ns
    timeout_ns = int.from_bytes(bytes.fromhex(launch["params"])[offset : offset + size], "little")
    assert compiled_at, "the wait did not compile flags.cu"
    assert timeout_ns <= (deadline - compiled_at[0]) * 1e9, (timeout_ns, (deadline - compiled_at[0]) * 1e9)
