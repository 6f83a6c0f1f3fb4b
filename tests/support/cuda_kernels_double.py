"""A ``CudaKernels`` as its ``__init__`` leaves it on a GPU, built on a host without one.

``cuda_kernels_on_the_double`` gives kernels whose images are nvcc's cubins (the ``nvcc_fatbins``
fixture of tests/conftest.py), whose driver is the driver double (tests/support/cuda_double) and
whose stream is a made-up handle (0xCAFE): their launches are recorded and run nothing.
``cuda_kernels_running_on_the_double`` gives kernels for CPU tensors whose images are host images
of the CUDA C++ kernels built for the host: every launch goes through gpucomm's launcher to the
double, which runs it, so the packed parameters move data. ``OnTheGpu`` stands for what a Region's byte view says
of GPU memory (a test sets ``OnTheGpu.device`` once torch is imported); ``NoCupy`` fails any use
of CuPy; ``RecordingCupy`` records what CuPy's Functions would have been called with.
"""

from __future__ import annotations

__all__ = ["NoCupy", "OnTheGpu", "RecordingCupy", "cuda_kernels_on_the_double", "cuda_kernels_running_on_the_double"]


class NoCupy:
    """In place of the cupy module: any use of it (a Function call converting its arguments, a
    stream, a device) fails the test."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"CudaKernels used CuPy ({name}) on a bound launch")


class OnTheGpu:
    """What a Region's byte view says of its memory: on the GPU (these addresses are made up)."""

    device = None  # set by the test, once torch is imported


def cuda_kernels_on_the_double(nvcc_fatbins, double: str, arch: int):
    """A CudaKernels as its __init__ leaves it on an sm_<arch> GPU, built by hand on a host without
    one: NVRTC's images are nvcc's cubins, the driver is the double, the stream a made-up handle."""
    import torch

    from gpucomm.ops import launcher
    from gpucomm.ops.cuda_ops import SOURCES, THREADS, CudaKernels

    kernels = CudaKernels.__new__(CudaKernels)
    kernels._device, kernels._index = torch.device("cpu"), 0  # the tables live in host memory here
    kernels._arch, kernels._binary_kind, kernels._sm_count = f"sm_{arch}", "cubin", 132
    kernels._modules, kernels._functions, kernels._tables, kernels._bound_functions = {}, {}, {}, {}
    defines = (("GPUCOMM_THREADS", str(THREADS)),)
    kernels._images = {(file, defines, f"sm_{arch}"): nvcc_fatbins.cubin(file, arch) for file in SOURCES}
    kernels._layouts = {}
    kernels._driver = launcher.driver(double)
    kernels._raw_stream = lambda: 0xCAFE
    kernels._cupy = NoCupy()
    return kernels


def cuda_kernels_running_on_the_double(double: str):
    """A CudaKernels for CPU tensors whose program and small kernels are the CUDA C++ kernels built
    for the host (gpucomm.ops.cuda_host), loaded as host images by the driver double and launched
    through gpucomm's launcher, with the GPU's block of GPUCOMM_THREADS threads. Only
    prepare_program and prepare_small serve (the contract's copy and reduce ask for CUDA memory)."""
    import ctypes

    import torch

    from gpucomm.ops import cuda_host, launcher
    from gpucomm.ops.cuda_ops import DEFINES, PROGRAM_PARAMS, SMALL_PARAMS, CudaKernels

    kernels = CudaKernels.__new__(CudaKernels)
    kernels._device, kernels._index = torch.device("cpu"), 0
    kernels._arch, kernels._binary_kind, kernels._sm_count = "host", "host", 4
    kernels._modules, kernels._functions, kernels._tables, kernels._bound_functions = {}, {}, {}, {}
    kernels._images, kernels._layouts = {}, {}
    key = tuple(sorted((k, str(v)) for k, v in DEFINES.items()))
    lib = ctypes.CDLL(double)
    for file, spec in (("program.cu", PROGRAM_PARAMS), ("small.cu", SMALL_PARAMS)):
        names = cuda_host.kernel_names(file, DEFINES)
        path = cuda_host.library(file, DEFINES)
        entries = "".join(f".entry {name}(\n" for name in names)
        kernels._images[(file, key, "host")] = f"//gpucomm-host-image {path}\n{entries}".encode() + b"\0"
        # The parameters as the launcher packs them, each at the next offset aligned to its size:
        # what a cubin tells the driver, and the double cannot read from a host library.
        offsets, sizes, at = [], [], 0
        for _, size in spec:
            at = -(-at // size) * size
            offsets.append(at)
            sizes.append(size)
            at += size
        for name in names:
            n = len(spec)
            lib.doubleSetParamInfo(name.encode(), n, (ctypes.c_size_t * n)(*offsets), (ctypes.c_size_t * n)(*sizes))
    kernels._driver = launcher.driver(double)
    kernels._raw_stream = lambda: 0
    kernels._cupy = NoCupy()
    return kernels


class RecordingCupy:
    """In place of the cupy module where the launcher cannot be built: its Functions record what
    they were called with (the bits of each argument as CuPy would pack it, the stream handle)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        outer = self

        class _Device:
            def __init__(self, index: int) -> None:
                pass

            def __enter__(self) -> None:
                pass

            def __exit__(self, *exc: object) -> None:
                pass

        class _Function:
            def __init__(self, name: str) -> None:
                self.name = name

            def __call__(self, grid, block, args, stream=None) -> None:
                words = [a.tobytes() for a in args]  # NumPy scalars: the bytes CuPy hands the driver
                outer.calls.append((self.name, grid, block, words, stream.ptr))

        self.cuda = type("cuda", (), {"Device": _Device})
        self.function = _Function
