"""``CudaKernels``: the kernel contract with the CUDA C++ kernels (``kernels/cuda/*.cu``).

:class:`CudaKernels` implements the kernel contract (:mod:`gpucomm.ops.contract`) on one CUDA
device, runs the device executor's programs (``run_program``, with ``program.cu``) and the
small-message all_reduce (``prepare_small``, with ``small.cu``: gpucomm.workspace.small). Each
file is compiled by NVRTC on first use for the device's architecture
(:mod:`gpucomm.ops.cuda_source`) and memoised in the instance, keyed by (file, sorted defines,
architecture). Launches go on torch's current stream of that device.

Launches: every kernel goes through gpucomm's launcher (:mod:`gpucomm.ops.launcher`) where it
can be built, each launch one ``cuLaunchKernel`` on the stream handle torch names. The program
kernel's launch (one per call of a program on its buffers) is packed once (``program_params``);
copy, reduce, signal and wait pack their words per call into a launch of the layout checked at
their first (:mod:`gpucomm.ops.cuda_params` lays out every kernel's parameters).
Where the launcher cannot be built (``GPUCOMM_NATIVE=0``, no C compiler), CuPy's ``Function``
launches them, and only there: it converts every argument on each call, and its launches are the
ones a GPU run's results did not follow (docs/results/2026-11-25-h100.md, "not explained").

The names of :mod:`gpucomm.ops.cuda_source` and :mod:`gpucomm.ops.cuda_params` are re-exported
here, where the tests and benchmarks that drive the CUDA kernels look for them.
"""

from __future__ import annotations

import functools
import importlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gpucomm.ops import launcher as _launcher
from gpucomm.ops._validate import check_copy, check_epoch, check_flags, check_reduce
from gpucomm.ops.contract import Region
from gpucomm.ops.cuda_params import (
    COPY_PARAMS,
    PROGRAM_FOLDS,
    PROGRAM_PARAMS,
    REDUCE_PARAMS,
    SIGNAL_PARAMS,
    SMALL_PARAMS,
    WAIT_PARAMS,
    check_program,
    check_small,
    copy_params,
    program_params,
    small_params,
)
from gpucomm.ops.cuda_source import (
    DEFINES,
    HEADER,
    KERNEL_PACKAGE,
    SOURCES,
    THREADS,
    compile_options,
    compile_source,
    kernel_source,
    program_kernel_name,
    reduce_kernel_name,
    small_kernel_name,
    target,
    unsupported,
)
from gpucomm.ops.launch_args import MAX_PROGRAM_WORLD, MAX_SMALL_WORLD, SMALL_OPS, ProgramArgs, SmallArgs
from gpucomm.ops.launcher import Param
from gpucomm.ops.tables import held
from gpucomm.reduce_op import ReduceOp

__all__ = [
    "CudaKernels",
    "KERNEL_PACKAGE",
    "SOURCES",
    "HEADER",
    "THREADS",
    "compile_options",
    "kernel_source",
    "program_kernel_name",
    "reduce_kernel_name",
    "PROGRAM_FOLDS",
    "MAX_PROGRAM_WORLD",
    "PROGRAM_PARAMS",
    "COPY_PARAMS",
    "REDUCE_PARAMS",
    "SIGNAL_PARAMS",
    "WAIT_PARAMS",
    "program_params",
    "copy_params",
    "SMALL_PARAMS",
    "SMALL_OPS",
    "MAX_SMALL_WORLD",
    "small_kernel_name",
    "small_params",
]

# Blocks per SM at most for grid-stride kernels: enough to cover latency, few enough that each
# thread handles several vectors of large inputs.
_BLOCKS_PER_SM = 4

# ld.acquire / st.release at system scope need sm_70.
_MIN_CAPABILITY = (7, 0)

# Address tables are cached per instance; a communicator uses a handful, so a full cache means
# callers pass ever-new addresses and old tables are simply dropped.
_MAX_TABLES = 1024


class CudaKernels:
    """The kernel contract on one CUDA device, with the CUDA C++ kernels.

    Args:
        device: the CUDA device (``None``: torch's current one). Regions passed in must be
            addressable from it (local memory or peer memory mapped through CUDA IPC).
        launcher: launch the program kernel and copies through gpucomm's launcher where it can be
            built (default); False launches them with CuPy's Function, as where it cannot (for
            benchmarks that compare the two).

    Raises:
        UnsupportedError: no CUDA, no CuPy, no NVRTC, or a GPU older than sm_70.

    Example::

        kernels = CudaKernels(torch.device("cuda", 0))
        kernels.reduce(Region.of(out), [Region.of(a), Region.of(b)], torch.float32, ReduceOp.SUM)
    """

    name = "cuda"

    def __init__(self, device: torch.device | str | int | None = None, *, launcher: bool = True) -> None:
        dev = torch.device("cuda") if device is None else torch.device(device)
        if dev.type != "cuda":
            raise unsupported(f"got device {dev}, expected a cuda device")
        if not torch.cuda.is_available():
            raise unsupported(
                f"torch.cuda.is_available() is False (torch {torch.__version__}, built with CUDA {torch.version.cuda})"
            )
        index = torch.cuda.current_device() if dev.index is None else dev.index
        capability = torch.cuda.get_device_capability(index)
        if capability < _MIN_CAPABILITY:
            raise unsupported(
                f"device {index} has compute capability {capability}, the flag kernels need at least {_MIN_CAPABILITY}"
            )
        try:
            self._cupy = importlib.import_module("cupy")
        except ImportError as exc:
            raise unsupported(f"CuPy is not installed ({exc}); pip install 'gpucomm[cuda13]' or [cuda12]") from exc
        self._nvrtc = importlib.import_module("cupy_backends.cuda.libs.nvrtc")
        try:
            supported = self._nvrtc.getSupportedArchs()
        except RuntimeError as exc:  # CuPy raises RuntimeError when libnvrtc cannot be loaded
            raise unsupported(f"NVRTC could not be loaded: {exc}") from exc

        self._device = torch.device("cuda", index)
        self._index = index
        self._arch, self._binary_kind = target(capability, supported)
        self._sm_count = torch.cuda.get_device_properties(index).multi_processor_count
        self._modules: dict[tuple[str, tuple[tuple[str, str], ...], str], Any] = {}
        self._functions: dict[tuple[str, str], Any] = {}
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}
        self._images: dict[tuple[str, tuple[tuple[str, str], ...], str], bytes] = {}
        self._bound_functions: dict[tuple[str, str], int] = {}
        self._layouts: dict[tuple[str, str], tuple[int, list]] = {}
        self._driver = _launcher.driver(None) if launcher else None  # None: CuPy's Function launches everything
        self._raw_stream = functools.partial(torch._C._cuda_getCurrentRawStream, index)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def arch(self) -> str:
        """What NVRTC compiles for: ``sm_XY`` (a cubin) or ``compute_XY`` (PTX the driver JITs)."""
        return self._arch

    # -- the contract --------------------------------------------------------------------------

    def copy(self, dst: Region, src: Region) -> None:
        """Copy ``src.nbytes`` bytes from src to dst (not overlapping); either may be a peer."""
        check_copy(dst, src)
        self._check_cuda("copy", [dst, src])
        if dst.nbytes == 0:
            return
        self._launch(
            "copy.cu", "gpucomm_copy", self._blocks(-(-dst.nbytes // 16)), COPY_PARAMS, (dst.addr, src.addr, dst.nbytes)
        )

    def prepare_copy(self, dst: Region, src: Region) -> Any:
        """The launch of one copy of ``src`` into ``dst``, checked and packed once: ``launch(stream)``
        of the result launches it (through gpucomm's launcher where it can be built). For
        benchmarks that time a bare launch: the price of ``cuLaunchKernel`` on this host."""
        check_copy(dst, src)
        self._check_cuda("prepare_copy", [dst, src])
        if dst.nbytes == 0:
            raise ValueError("CudaKernels.prepare_copy: expected a copy of at least 1 byte, got 0 (nothing to launch)")
        blocks = self._blocks(-(-dst.nbytes // 16))
        params = copy_params(dst.addr, src.addr, dst.nbytes)
        if self._driver is None:
            return _CupyLaunch(self, "copy.cu", "gpucomm_copy", blocks, params)
        function = self._bound_function("copy.cu", "gpucomm_copy")
        return _launcher.bind(self._driver, function, params, grid=(blocks, 1, 1), block=(THREADS, 1, 1))

    def reduce(
        self,
        out: Region,
        srcs: Sequence[Region],
        dtype: torch.dtype,
        op: ReduceOp,
        divisor: int = 1,
    ) -> None:
        """``out = op(srcs[0], srcs[1], ...)`` element-wise, folded in the order given."""
        op, n = self._check_reduce("reduce", out, srcs, dtype, op, divisor)
        if n == 0:
            return
        values = (out.addr, self._table([s.addr for s in srcs]).data_ptr(), len(srcs), n, divisor)
        blocks = self._blocks(-(-out.nbytes // 16))
        self._launch("reduce.cu", reduce_kernel_name(dtype, op), blocks, REDUCE_PARAMS, values)

    def signal(self, flags: Sequence[Region], epoch: int) -> None:
        """Store ``epoch`` into every flag, release at system scope, after this stream's earlier work."""
        self._check_flags("signal", flags, epoch)
        if not flags:
            return
        table = self._table([f.addr for f in flags])
        self._launch("flags.cu", "gpucomm_signal", 1, SIGNAL_PARAMS, (table.data_ptr(), len(flags), epoch))

    def wait(self, flags: Sequence[Region], epoch: int, deadline: float) -> list[int]:
        """Indices of the flags still below ``epoch`` at the deadline (``time.monotonic()``); [] if none.

        Blocks the host until the wait kernel ends. The kernel's time limit is what is left of the
        deadline at launch, taken after the kernel is compiled and loaded (a first wait's NVRTC
        compile is no part of its wait); a kernel queued behind earlier work starts its clock late.
        """
        self._check_flags("wait", flags, epoch)
        if not flags:
            return []
        table = self._table([f.addr for f in flags])
        status = self._status(len(flags), epoch)
        self._load("flags.cu", "gpucomm_wait", WAIT_PARAMS)
        values = (table.data_ptr(), len(flags), epoch, _timeout_ns(deadline), status.data_ptr())
        self._launch("flags.cu", "gpucomm_wait", 1, WAIT_PARAMS, values)
        return _missing(status, epoch)

    def run_program(self, args: ProgramArgs) -> None:
        """One launch of ``kernels/cuda/program.cu`` on torch's current stream (:meth:`prepare_program`)."""
        self.prepare_program(args).launch(self._raw_stream())

    def prepare_program(self, args: ProgramArgs) -> Any:
        """The launch of ``kernels/cuda/program.cu`` that ``args`` describe, checked and packed once:
        ``launch(stream)`` of the result launches it (one ``cuLaunchKernel`` through gpucomm's
        launcher). A launch neither waits for the device nor allocates: a CUDA graph can capture it.

        ``args.copy_bytes`` and ``args.aligned`` are not needed here: the CUDA kernel picks its
        access width from each range's own addresses, so a misaligned access (a fatal CUDA error)
        cannot happen, and the aligned parts of an otherwise unaligned program still move 16-byte
        vectors.

        Raises:
            TypeError, ValueError: an argument the kernel cannot take (:func:`_check_program`).
        """
        kernel = check_program(self._device, args)
        params = program_params(args)
        if self._driver is None:
            return _CupyLaunch(self, "program.cu", kernel, args.channels, params)
        function = self._bound_function("program.cu", kernel)
        return _launcher.bind(self._driver, function, params, grid=(args.channels, 1, 1), block=(THREADS, 1, 1))

    def prepare_small(self, args: SmallArgs) -> Any:
        """The launch of ``kernels/cuda/small.cu``'s all_reduce that ``args`` describe, packed once:
        ``launch(stream)`` of the result is one ``cuLaunchKernel``. It neither waits for the
        device nor allocates, and its parameters are all it reads besides the workspace: a CUDA
        graph can capture it.

        Raises:
            TypeError, ValueError: an argument the kernel cannot take.
        """
        check_small(args)
        kernel = small_kernel_name(args.dtype, ReduceOp(args.op))
        params = small_params(args)
        if self._driver is None:
            return _CupyLaunch(self, "small.cu", kernel, args.channels, params)
        function = self._bound_function("small.cu", kernel)
        return _launcher.bind(self._driver, function, params, grid=(args.channels, 1, 1), block=(THREADS, 1, 1))

    # -- checks (shared ones in gpucomm.ops._validate, plus: the memory must be CUDA's) --------

    def _check_cuda(self, fn: str, regions: Sequence[Region]) -> None:
        for region in regions:
            if region.device.type != "cuda":
                raise ValueError(f"CudaKernels.{fn}: expected regions of CUDA memory, got one on {region.device}")

    def _check_reduce(
        self, fn: str, out: Region, srcs: Sequence[Region], dtype: torch.dtype, op: object, divisor: int
    ) -> tuple[ReduceOp, int]:
        """Checked op and the element count."""
        op = check_reduce(out, srcs, dtype, op, divisor)
        self._check_cuda(fn, [out, *srcs])
        return op, out.nbytes // torch.empty(0, dtype=dtype).element_size()

    def _check_flags(self, fn: str, flags: Sequence[Region], epoch: int) -> None:
        check_flags(fn, flags)
        check_epoch(fn, epoch)
        self._check_cuda(fn, flags)

    # -- launching -----------------------------------------------------------------------------

    def _blocks(self, vectors: int) -> int:
        return max(1, min(-(-vectors // THREADS), self._sm_count * _BLOCKS_PER_SM))

    def _table(self, addrs: list[int]) -> torch.Tensor:
        """A device int64 tensor holding ``addrs`` (cached: tables repeat call after call), held by
        the current stream, which the launch that reads it goes on (:func:`gpucomm.ops.tables.held`)."""
        key = tuple(addrs)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) >= _MAX_TABLES:
                self._tables.clear()
            table = torch.tensor(addrs, dtype=torch.int64).to(self._device)
            self._tables[key] = table
        return held(table)

    def _status(self, n: int, epoch: int) -> torch.Tensor:
        """A fresh error record {0, epoch, ..., epoch} (see wait_flags_block in common.cuh)."""
        return torch.tensor([0] + [epoch] * n, dtype=torch.int64).to(self._device)

    def _launch(
        self, file: str, kernel: str, blocks: int, spec: Sequence[tuple[str, int]], values: Sequence[int]
    ) -> None:
        """One launch of ``kernel`` over ``blocks`` blocks on torch's current stream, its parameters
        (named and sized by ``spec``) carrying ``values``."""
        if self._driver is None:
            self._launch_on(file, kernel, blocks, _cupy_args(spec, values), self._raw_stream())
            return
        function, layout = self._checked_layout(file, kernel, spec)
        # A launch of its own per call (its words packed by the launcher, no Python object per
        # word), not one launch's words rewritten in place: the host executor and the
        # point-to-point channels may call from several threads at once.
        self._driver.bind(function, (blocks, 1, 1), (THREADS, 1, 1), 0, layout, values).launch(self._raw_stream())

    def _load(self, file: str, kernel: str, spec: Sequence[tuple[str, int]]) -> None:
        """Compile and load ``kernel`` now if not yet, the way :meth:`_launch` will launch it."""
        if self._driver is None:
            self._function(file, kernel)
        else:
            self._checked_layout(file, kernel, spec)

    def _checked_layout(self, file: str, kernel: str, spec: Sequence[tuple[str, int]]) -> tuple[int, list]:
        """``kernel``'s CUfunction and its parameters' [(offset, size)], checked against the
        kernel's own layout once (:func:`gpucomm.ops.launcher.bind`)."""
        key = (file, kernel)
        found = self._layouts.get(key)
        if found is None:
            function = self._bound_function(file, kernel)
            first = _launcher.bind(
                self._driver, function, [Param(n, size, 0) for n, size in spec], grid=(1, 1, 1), block=(THREADS, 1, 1)
            )
            found = self._layouts[key] = (function, [tuple(p) for p in first.layout])
        return found

    def _launch_on(self, file: str, kernel: str, blocks: int, args: tuple, stream_handle: int) -> None:
        function = self._function(file, kernel)
        with self._cupy.cuda.Device(self._device.index):
            function((blocks,), (THREADS,), args, stream=_StreamHandle(stream_handle))

    def _bound_function(self, file: str, kernel: str) -> int:
        """The CUfunction of ``kernel`` in ``file``'s image, loaded through gpucomm's launcher."""
        key = (file, kernel)
        function = self._bound_functions.get(key)
        if function is None:
            function = self._driver.load(self._image(file, DEFINES), kernel, self._index)
            self._bound_functions[key] = function
        return function

    def _function(self, file: str, kernel: str) -> Any:
        key = (file, kernel)
        function = self._functions.get(key)
        if function is None:
            function = self._module(file, DEFINES).get_function(kernel)
            self._functions[key] = function
        return function

    def _image(self, file: str, defines: Mapping[str, object]) -> bytes:
        """``file`` compiled by NVRTC (a cubin, or PTX), once per instance."""
        key = (file, tuple(sorted((k, str(v)) for k, v in defines.items())), self._arch)
        image = self._images.get(key)
        if image is None:
            image = self._images[key] = self._compile(file, defines)
        return image

    def _module(self, file: str, defines: Mapping[str, object]) -> Any:
        key = (file, tuple(sorted((k, str(v)) for k, v in defines.items())), self._arch)
        module = self._modules.get(key)
        if module is None:
            binary = self._image(file, defines)
            module = self._cupy.cuda.function.Module()
            with self._cupy.cuda.Device(self._device.index):
                module.load(binary)
            self._modules[key] = module
        return module

    def _compile(self, file: str, defines: Mapping[str, object]) -> bytes:
        return compile_source(self._nvrtc, file, self._arch, self._binary_kind, defines)


class _StreamHandle:
    """A stream as CuPy's Function reads it: its handle (``.ptr``, all ``Function.__call__`` takes
    of a stream in CuPy 14), with no CuPy Stream made, kept or collected per stream handle."""

    __slots__ = ("ptr",)

    def __init__(self, handle: int) -> None:
        self.ptr = handle


class _CupyLaunch:
    """A program kernel's launch through CuPy's Function (it converts every argument on each call),
    where gpucomm's launcher cannot be built."""

    def __init__(self, kernels: CudaKernels, file: str, kernel: str, blocks: int, params: Sequence[Param]) -> None:
        args = _cupy_args([(p.name, p.size) for p in params], [p.value for p in params])
        self._launch = functools.partial(kernels._launch_on, file, kernel, blocks, args)

    def launch(self, stream: int) -> None:
        self._launch(stream)


def _cupy_args(spec: Sequence[tuple[str, int]], values: Sequence[int]) -> tuple:
    """Parameters as CuPy's Function packs them: each value as a NumPy scalar of its size, signed
    or not alike (the bits are what the kernel reads)."""
    types = {4: np.uint32, 8: np.uint64}
    return tuple(types[size](value % (1 << 8 * size)) for (_, size), value in zip(spec, values, strict=True))


def _timeout_ns(deadline: float) -> int:
    return min(max(0, round((deadline - time.monotonic()) * 1e9)), 2**64 - 1)


def _missing(status: torch.Tensor, epoch: int) -> list[int]:
    record = status.cpu().tolist()  # waits for the kernel (current stream)
    if record[0] == 0:
        return []
    return [i for i, seen in enumerate(record[1:]) if seen < epoch]
