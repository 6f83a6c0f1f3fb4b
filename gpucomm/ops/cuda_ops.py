"""The CUDA C++ kernels (``kernels/cuda/*.cu``): run-time compilation and launchers.

:class:`CudaKernels` implements the kernel contract (:mod:`gpucomm.ops.contract`) on one CUDA
device, runs the device executor's programs (``run_program``, with ``program.cu``) and the
small-message all_reduce (``prepare_small``, with ``small.cu``: gpucomm.workspace.small). The
``.cu`` sources ship inside the package (``gpucomm._kernels.cuda``); each file is compiled by
NVRTC on first use for the device's architecture and memoised in the instance, keyed by (file,
sorted defines, architecture). Launches go on torch's current stream of that device.

NVRTC is driven through CuPy's thin binding (``cupy_backends.cuda.libs.nvrtc``) rather than
``cupy.RawModule``: RawModule appends ``-ftz=true`` after the caller's options, and flushing
subnormals to zero would break the bitwise agreement with the torch reference (bf16 and fp32
subnormals). Here the options are exactly :func:`compile_options`, which CI also hands to nvcc
(tests/ops/test_cuda_compile.py).

Launches: every kernel goes through gpucomm's launcher (:mod:`gpucomm.ops.launcher`) where it
can be built, each launch one ``cuLaunchKernel`` on the stream handle torch names. The program
kernel's launch (one per call of a program on its buffers) is packed once (:func:`program_params`);
copy, reduce, signal and wait pack their words per call into a launch of the layout checked at
their first (:data:`COPY_PARAMS`, :data:`REDUCE_PARAMS`, :data:`SIGNAL_PARAMS`,
:data:`WAIT_PARAMS`), all in the order and sizes of the kernels' ``extern "C"`` signatures. Where the launcher cannot be built
(``GPUCOMM_NATIVE=0``, no C compiler), CuPy's ``Function`` launches them: it converts every
argument on each call, and on the one H100 run so far (2026-11-25) its launches were the ones
that results did not follow (docs/results/2026-11-25-h100.md, "not explained"), so it serves only
there.
"""

from __future__ import annotations

import functools
import importlib
import importlib.resources
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gpucomm.errors import KernelCompileError, UnsupportedError
from gpucomm.ops import launcher as _launcher
from gpucomm.ops._validate import check_copy, check_epoch, check_flags, check_reduce
from gpucomm.ops.contract import SUPPORTED_DTYPES, Region
from gpucomm.ops.launcher import Param
from gpucomm.ops.program import FP_BITS, OPERAND_WORDS, WORDS
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

KERNEL_PACKAGE = "gpucomm._kernels.cuda"
SOURCES = ("copy.cu", "reduce.cu", "flags.cu", "program.cu", "small.cu")
HEADER = "common.cuh"

# Threads per block of every launch, passed to the sources as -DGPUCOMM_THREADS (their
# __launch_bounds__). 512 keeps enough loads in flight per SM for copies and reduces.
THREADS = 512
_DEFINES = {"GPUCOMM_THREADS": THREADS}

# Blocks per SM at most for grid-stride kernels: enough to cover latency, few enough that each
# thread handles several vectors of large inputs.
_BLOCKS_PER_SM = 4

# ld.acquire / st.release at system scope need sm_70.
_MIN_CAPABILITY = (7, 0)

# Address tables are cached per instance; a communicator uses a handful, so a full cache means
# callers pass ever-new addresses and old tables are simply dropped.
_MAX_TABLES = 1024

_OP_NAMES = {
    ReduceOp.SUM: "sum",
    ReduceOp.PRODUCT: "prod",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.AVG: "avg",
}
_DTYPE_NAMES = {dtype: str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES}

# The folds the program kernels are built for: a program's AVG folds as SUM and each of its
# REDUCEs says whether it divides (gpucomm.ops.program).
PROGRAM_FOLDS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
# A SYNC names its peers in an int64 bit mask (program.cu's MAX_PEERS - 1).
MAX_PROGRAM_WORLD = 63


# The parameters of program.cu's kernels (GPUCOMM_PROGRAM_PARAMS) and of copy.cu's gpucomm_copy,
# with their sizes in bytes: pointers and 64-bit integers 8, int 4.
PROGRAM_PARAMS = (
    ("prog", 8),
    ("n_instr", 8),
    ("operands", 8),
    ("peers", 8),
    ("state", 8),
    ("record", 8),
    ("rank", 4),
    ("world", 4),
    ("fingerprint", 8),
    ("half_bytes", 8),
    ("granule", 8),
    ("timeout_ns", 8),
    ("all_channels", 4),
)
COPY_PARAMS = (("dst", 8), ("src", 8), ("nbytes", 8))
# The parameters of small.cu's kernels (GPUCOMM_SMALL_PARAMS): every rank's half 0 and flag area
# travel as parameters of their own, up to MAX_SMALL_WORLD ranks (0 past the workspace's).
MAX_SMALL_WORLD = 8
SMALL_PARAMS = (
    ("x", 8),
    ("n", 8),
    *((f"stage{p}", 8) for p in range(MAX_SMALL_WORLD)),
    *((f"flags{p}", 8) for p in range(MAX_SMALL_WORLD)),
    ("half_bytes", 8),
    ("state", 8),
    ("record", 8),
    ("rank", 4),
    ("world", 4),
    ("fingerprint", 8),
    ("timeout_ns", 8),
    ("all_channels", 4),
    ("divisor", 8),
)
# The small kernels fold with every op, AVG included (it divides once at the end).
SMALL_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)
# reduce.cu's gpucomm_reduce_<op>_<dtype> and flags.cu's gpucomm_signal / gpucomm_wait.
REDUCE_PARAMS = (("out", 8), ("srcs", 8), ("k", 4), ("n", 8), ("divisor", 8))
SIGNAL_PARAMS = (("flag_addrs", 8), ("n", 4), ("epoch", 8))
WAIT_PARAMS = (("flag_addrs", 8), ("n", 4), ("epoch", 8), ("timeout_ns", 8), ("status", 8))


def program_params(
    instructions: torch.Tensor,
    operands: torch.Tensor,
    peers: torch.Tensor,
    state_addr: int,
    record_addr: int,
    rank: int,
    world: int,
    fingerprint: int,
    half_bytes: int,
    granule: int,
    timeout_ns: int,
    all_channels: int,
) -> list[Param]:
    """The program kernel's parameters (program.cu's GPUCOMM_PROGRAM_PARAMS) carrying a launch's values."""
    values = (
        instructions.data_ptr(),
        instructions.numel() // WORDS,
        operands.data_ptr(),
        peers.data_ptr(),
        state_addr,
        record_addr,
        rank,
        world,
        fingerprint,
        half_bytes,
        granule,
        timeout_ns,
        all_channels,
    )
    return [Param(name, size, value) for (name, size), value in zip(PROGRAM_PARAMS, values)]


def copy_params(dst: int, src: int, nbytes: int) -> list[Param]:
    """gpucomm_copy's parameters carrying a copy's addresses and size."""
    return [Param(name, size, value) for (name, size), value in zip(COPY_PARAMS, (dst, src, nbytes))]


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


def small_params(
    x: int,
    n: int,
    stages: Sequence[int],
    flags: Sequence[int],
    half_bytes: int,
    state_addr: int,
    record_addr: int,
    rank: int,
    fingerprint: int,
    timeout_ns: int,
    all_channels: int,
    divisor: int,
) -> list[Param]:
    """small.cu's parameters (GPUCOMM_SMALL_PARAMS) carrying a launch's values."""
    world = len(stages)
    pad = [0] * (MAX_SMALL_WORLD - world)
    values = (
        x,
        n,
        *stages,
        *pad,
        *flags,
        *pad,
        half_bytes,
        state_addr,
        record_addr,
        rank,
        world,
        fingerprint,
        timeout_ns,
        all_channels,
        divisor,
    )
    return [Param(name, size, value) for (name, size), value in zip(SMALL_PARAMS, values, strict=True)]


def compile_options(arch: str, defines: Mapping[str, object]) -> tuple[str, ...]:
    """The compiler options of every kernel file, valid for NVRTC and nvcc alike.

    ``arch`` is ``sm_XY`` (a cubin) or ``compute_XY`` (PTX). Rounding is pinned so that results
    match the torch reference bitwise: no FMA contraction, no flush to zero, IEEE division.
    """
    return (
        "-std=c++17",
        f"--gpu-architecture={arch}",
        "--fmad=false",
        "-ftz=false",
        "-prec-div=true",
        "-prec-sqrt=true",
        *(f"-D{name}={value}" for name, value in sorted(defines.items())),
    )


def kernel_source(name: str) -> str:
    """The text of one file of ``kernels/cuda`` as shipped in the package."""
    return importlib.resources.files(KERNEL_PACKAGE).joinpath(name).read_text(encoding="utf-8")


def _unsupported(reason: str) -> UnsupportedError:
    return UnsupportedError(f"gpucomm: GPUCOMM_KERNELS=cuda needs a CUDA device and CuPy with NVRTC: {reason}")


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
            raise _unsupported(f"got device {dev}, expected a cuda device")
        if not torch.cuda.is_available():
            raise _unsupported(
                f"torch.cuda.is_available() is False (torch {torch.__version__}, built with CUDA {torch.version.cuda})"
            )
        index = torch.cuda.current_device() if dev.index is None else dev.index
        capability = torch.cuda.get_device_capability(index)
        if capability < _MIN_CAPABILITY:
            raise _unsupported(
                f"device {index} has compute capability {capability}, the flag kernels need at least {_MIN_CAPABILITY}"
            )
        try:
            self._cupy = importlib.import_module("cupy")
        except ImportError as exc:
            raise _unsupported(f"CuPy is not installed ({exc}); pip install 'gpucomm[cuda13]' or [cuda12]") from exc
        self._nvrtc = importlib.import_module("cupy_backends.cuda.libs.nvrtc")
        try:
            supported = self._nvrtc.getSupportedArchs()
        except RuntimeError as exc:  # CuPy raises RuntimeError when libnvrtc cannot be loaded
            raise _unsupported(f"NVRTC could not be loaded: {exc}") from exc

        self._device = torch.device("cuda", index)
        self._index = index
        self._arch, self._binary_kind = _target(capability, supported)
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

    def run_program(self, instructions: torch.Tensor, *args: object, **kwargs: object) -> None:
        """One launch of ``kernels/cuda/program.cu`` on torch's current stream (the arguments of
        :meth:`prepare_program`)."""
        self.prepare_program(instructions, *args, **kwargs).launch(self._raw_stream())

    def prepare_program(
        self,
        instructions: torch.Tensor,
        operands: torch.Tensor,
        peers: torch.Tensor,
        state_addr: int,
        record_addr: int,
        *,
        channels: int,
        rank: int,
        world: int,
        fingerprint: int,
        half_bytes: int,
        granule: int,
        timeout_ns: int,
        dtype: torch.dtype | None,
        op: int,
        copy_bytes: int,
        aligned: bool,
        all_channels: int | None = None,
    ) -> Any:
        """The launch of ``kernels/cuda/program.cu`` over ``channels`` blocks, checked and packed
        once: ``launch(stream)`` of the result launches it (one ``cuLaunchKernel`` through gpucomm's
        launcher). ``all_channels`` (default ``channels``) is how many the flag layout has, whose
        epochs the launch keeps in step.

        The arguments mean what they mean for ``TritonKernels.prepare_program``
        (:mod:`gpucomm.workspace.device_executor` describes them). ``copy_bytes`` and ``aligned`` are
        accepted for that common signature and not needed: the CUDA kernel picks its access width
        from each range's own addresses, so a misaligned access (a fatal CUDA error) cannot happen,
        and the aligned parts of an otherwise unaligned program still move 16-byte vectors.

        A launch neither waits for the device nor allocates: a CUDA graph can capture it.
        """
        all_channels = channels if all_channels is None else all_channels
        kernel = _check_program(
            self._device,
            instructions,
            operands,
            peers,
            state_addr,
            record_addr,
            channels,
            rank,
            world,
            fingerprint,
            half_bytes,
            granule,
            timeout_ns,
            dtype,
            op,
            all_channels,
        )
        params = program_params(
            instructions,
            operands,
            peers,
            state_addr,
            record_addr,
            rank,
            world,
            fingerprint,
            half_bytes,
            granule,
            timeout_ns,
            all_channels,
        )
        if self._driver is None:
            return _CupyLaunch(self, "program.cu", kernel, channels, params)
        function = self._bound_function("program.cu", kernel)
        return _launcher.bind(self._driver, function, params, grid=(channels, 1, 1), block=(THREADS, 1, 1))

    def prepare_small(
        self,
        x: int,
        n: int,
        stages: Sequence[int],
        flags: Sequence[int],
        *,
        half_bytes: int,
        state_addr: int,
        record_addr: int,
        rank: int,
        fingerprint: int,
        timeout_ns: int,
        channels: int,
        all_channels: int,
        divisor: int,
        dtype: torch.dtype,
        op: ReduceOp,
    ) -> Any:
        """The launch of ``kernels/cuda/small.cu``'s all_reduce of the ``n`` elements of ``dtype``
        at ``x`` over ``channels`` blocks (gpucomm.workspace.small describes the arguments), packed once:
        ``launch(stream)`` of the result is one ``cuLaunchKernel``. It neither waits for the
        device nor allocates, and its parameters are all it reads besides the workspace: a CUDA
        graph can capture it."""
        fn = "CudaKernels.prepare_small"
        _check_int(fn, "world", len(stages), 1, MAX_SMALL_WORLD)
        if len(flags) != len(stages):
            raise ValueError(f"{fn}: one flag area per rank expected, got {len(flags)} for {len(stages)} ranks")
        _check_int(fn, "rank", rank, 0, len(stages) - 1)
        _check_int(fn, "channels", channels, 1, 2**31 - 1)
        _check_int(fn, "all_channels", all_channels, channels, 2**31 - 1)
        _check_int(fn, "fingerprint", fingerprint, 0, (1 << FP_BITS) - 1)
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: dtype must be one of {list(SUPPORTED_DTYPES)}, got {dtype}")
        if op not in SMALL_OPS:
            raise ValueError(f"{fn}: op must be one of {[o.name for o in SMALL_OPS]}, got {op!r}")
        kernel = small_kernel_name(dtype, ReduceOp(op))
        params = small_params(
            x,
            n,
            stages,
            flags,
            half_bytes,
            state_addr,
            record_addr,
            rank,
            fingerprint,
            timeout_ns,
            all_channels,
            divisor,
        )
        if self._driver is None:
            return _CupyLaunch(self, "small.cu", kernel, channels, params)
        function = self._bound_function("small.cu", kernel)
        return _launcher.bind(self._driver, function, params, grid=(channels, 1, 1), block=(THREADS, 1, 1))

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
            function = self._driver.load(self._image(file, _DEFINES), kernel, self._index)
            self._bound_functions[key] = function
        return function

    def _function(self, file: str, kernel: str) -> Any:
        key = (file, kernel)
        function = self._functions.get(key)
        if function is None:
            function = self._module(file, _DEFINES).get_function(kernel)
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
        nvrtc = self._nvrtc
        options = compile_options(self._arch, defines)
        program = nvrtc.createProgram(kernel_source(file), file, [kernel_source(HEADER).encode()], [HEADER.encode()])
        try:
            try:
                nvrtc.compileProgram(program, options)
            except nvrtc.NVRTCError as exc:
                raise KernelCompileError(
                    f"gpucomm: NVRTC failed to compile kernels/cuda/{file} with {' '.join(options)}:\n"
                    f"{nvrtc.getProgramLog(program)}"
                ) from exc
            if self._binary_kind == "cubin":
                return nvrtc.getCUBIN(program)
            # cuModuleLoadData reads PTX as a NUL-terminated string; getPTX strips the NUL.
            return nvrtc.getPTX(program) + b"\0"
        finally:
            nvrtc.destroyProgram(program)


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


def _target(capability: tuple[int, int], supported: Sequence[int]) -> tuple[str, str]:
    """(arch option, binary kind) for a device: a cubin where NVRTC knows the GPU, else PTX of the
    newest architecture it knows below it (the driver JIT-compiles PTX for newer GPUs)."""
    cc = capability[0] * 10 + capability[1]
    if cc in supported:
        return f"sm_{cc}", "cubin"
    older = [a for a in supported if a <= cc]
    if not older:
        raise _unsupported(f"NVRTC supports {sorted(supported)}, none at or below this device's sm_{cc}")
    return f"compute_{max(older)}", "ptx"


def _check_program(
    device: torch.device,
    instructions: torch.Tensor,
    operands: torch.Tensor,
    peers: torch.Tensor,
    state_addr: int,
    record_addr: int,
    channels: int,
    rank: int,
    world: int,
    fingerprint: int,
    half_bytes: int,
    granule: int,
    timeout_ns: int,
    dtype: torch.dtype | None,
    op: int,
    all_channels: int | None = None,
) -> str:
    """Check run_program's arguments (cheaply: it runs on every call); the kernel's name."""
    fn = "CudaKernels.run_program"
    _check_int(fn, "world", world, 1, MAX_PROGRAM_WORLD)
    for name, table, width in (("instructions", instructions, WORDS), ("operands", operands, OPERAND_WORDS)):
        _check_table(fn, name, table, device)
        if table.numel() == 0 or table.numel() % width:
            raise ValueError(f"{fn}: {name} must hold a positive multiple of {width} int64, got {table.numel()}")
    _check_table(fn, "peers", peers, device)
    if peers.numel() != 2 * world:
        raise ValueError(f"{fn}: peers must hold 2 * world = {2 * world} addresses, got {peers.numel()}")
    _check_int(fn, "rank", rank, 0, world - 1)
    _check_int(fn, "channels", channels, 1, 2**31 - 1)
    if all_channels is not None:
        _check_int(fn, "all_channels", all_channels, channels, 2**31 - 1)
    _check_int(fn, "fingerprint", fingerprint, 0, (1 << FP_BITS) - 1)
    _check_int(fn, "granule", granule, 1, 2**63 - 1)
    _check_int(fn, "half_bytes", half_bytes, 0, 2**63 - 1)
    _check_int(fn, "timeout_ns", timeout_ns, 0, 2**64 - 1)
    _check_int(fn, "state_addr", state_addr, 1, 2**64 - 1)
    _check_int(fn, "record_addr", record_addr, 1, 2**64 - 1)
    if dtype is None:
        return program_kernel_name(None, ReduceOp.SUM)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: dtype must be None or one of {list(SUPPORTED_DTYPES)}, got {dtype}")
    if isinstance(op, bool) or op not in PROGRAM_FOLDS:
        folds = [f"{int(f)} ({f.name})" for f in PROGRAM_FOLDS]
        raise ValueError(f"{fn}: op must be a fold, one of {folds} (AVG programs fold as SUM), got {op!r}")
    return program_kernel_name(dtype, ReduceOp(op))


def _check_table(fn: str, name: str, table: object, device: torch.device) -> None:
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(table).__name__}")
    if table.dtype != torch.int64:
        raise TypeError(f"{fn}: {name} must be an int64 tensor, got {table.dtype}")
    if table.dim() != 1 or not table.is_contiguous():
        raise ValueError(f"{fn}: {name} must be a contiguous 1-D tensor, got shape {tuple(table.shape)}")
    if table.device != device:
        raise ValueError(f"{fn}: {name} is on {table.device}, expected {device} (the kernels' device)")


def _check_int(fn: str, name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{fn}: {name} must be in [{low}, {high}], got {value}")


def _timeout_ns(deadline: float) -> int:
    return min(max(0, round((deadline - time.monotonic()) * 1e9)), 2**64 - 1)


def _missing(status: torch.Tensor, epoch: int) -> list[int]:
    record = status.cpu().tolist()  # waits for the kernel (current stream)
    if record[0] == 0:
        return []
    return [i for i, seen in enumerate(record[1:]) if seen < epoch]
