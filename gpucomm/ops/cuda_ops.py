"""The CUDA C++ kernels (``kernels/cuda/*.cu``): run-time compilation and launchers.

:class:`CudaKernels` implements the kernel contract (:mod:`gpucomm.ops.contract`) on one CUDA
device, and runs the device executor's programs (``run_program``, with ``program.cu``). The
``.cu`` sources ship inside the package (``gpucomm._kernels.cuda``); each file is compiled by
NVRTC on first use for the device's architecture and memoised in the instance, keyed by (file,
sorted defines, architecture). Launches go on torch's current stream of that device.

NVRTC is driven through CuPy's thin binding (``cupy_backends.cuda.libs.nvrtc``) rather than
``cupy.RawModule``: RawModule appends ``-ftz=true`` after the caller's options, and flushing
subnormals to zero would break the bitwise agreement with the torch reference (bf16 and fp32
subnormals). Here the options are exactly :func:`compile_options`, which CI also hands to nvcc
(tests/test_cuda_compile.py).
"""

from __future__ import annotations

import importlib
import importlib.resources
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from gpucomm.errors import KernelCompileError, UnsupportedError
from gpucomm.ops._validate import check_copy, check_epoch, check_flags, check_reduce
from gpucomm.ops.contract import SUPPORTED_DTYPES, Region
from gpucomm.program import FP_BITS, OPERAND_WORDS, WORDS
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
]

KERNEL_PACKAGE = "gpucomm._kernels.cuda"
SOURCES = ("copy.cu", "reduce.cu", "flags.cu", "program.cu")
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
# REDUCEs says whether it divides (gpucomm.program).
PROGRAM_FOLDS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
# A SYNC names its peers in an int64 bit mask (program.cu's MAX_PEERS - 1).
MAX_PROGRAM_WORLD = 63


def reduce_kernel_name(dtype: torch.dtype, op: ReduceOp) -> str:
    """The ``extern "C"`` name of the reduce kernel for dtype × op."""
    return f"gpucomm_reduce_{_OP_NAMES[op]}_{_DTYPE_NAMES[dtype]}"


def program_kernel_name(dtype: torch.dtype | None, op: ReduceOp) -> str:
    """The ``extern "C"`` name of the program kernel for a program's dtype and fold (one of
    PROGRAM_FOLDS); ``dtype`` None (a program without REDUCE) names the copy-only kernel."""
    if dtype is None:
        return "gpucomm_program_copy"
    return f"gpucomm_program_{_OP_NAMES[op]}_{_DTYPE_NAMES[dtype]}"


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

    Raises:
        UnsupportedError: no CUDA, no CuPy, no NVRTC, or a GPU older than sm_70.

    Example::

        kernels = CudaKernels(torch.device("cuda", 0))
        kernels.reduce(Region.of(out), [Region.of(a), Region.of(b)], torch.float32, ReduceOp.SUM)
    """

    name = "cuda"

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        dev = torch.device("cuda") if device is None else torch.device(device)
        if dev.type != "cuda":
            raise _unsupported(f"got device {dev}, expected a cuda device")
        if not torch.cuda.is_available():
            raise _unsupported(
                f"torch.cuda.is_available() is False (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda})"
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
        self._arch, self._binary_kind = _target(capability, supported)
        self._sm_count = torch.cuda.get_device_properties(index).multi_processor_count
        self._modules: dict[tuple[str, tuple[tuple[str, str], ...], str], Any] = {}
        self._functions: dict[tuple[str, str], Any] = {}
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}
        self._streams: dict[int, Any] = {}

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
        blocks = self._blocks(-(-dst.nbytes // 16))
        self._launch("copy.cu", "gpucomm_copy", blocks, (np.uint64(dst.addr), np.uint64(src.addr), np.uint64(dst.nbytes)))

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
        args = (np.uint64(out.addr), np.uint64(self._table([s.addr for s in srcs]).data_ptr()),
                np.int32(len(srcs)), np.uint64(n), np.int64(divisor))
        blocks = self._blocks(-(-out.nbytes // 16))
        self._launch("reduce.cu", reduce_kernel_name(dtype, op), blocks, args)

    def signal(self, flags: Sequence[Region], epoch: int) -> None:
        """Store ``epoch`` into every flag, release at system scope, after this stream's earlier work."""
        self._check_flags("signal", flags, epoch)
        if not flags:
            return
        table = self._table([f.addr for f in flags])
        self._launch("flags.cu", "gpucomm_signal", 1, (np.uint64(table.data_ptr()), np.int32(len(flags)), np.int64(epoch)))

    def wait(self, flags: Sequence[Region], epoch: int, deadline: float) -> list[int]:
        """Indices of the flags still below ``epoch`` at the deadline (``time.monotonic()``); [] if none.

        Blocks the host until the wait kernel ends. The kernel's time limit is what is left of the
        deadline at launch; a kernel queued behind earlier work starts its clock late.
        """
        self._check_flags("wait", flags, epoch)
        if not flags:
            return []
        table = self._table([f.addr for f in flags])
        status = self._status(len(flags), epoch)
        args = (np.uint64(table.data_ptr()), np.int32(len(flags)), np.int64(epoch),
                np.uint64(_timeout_ns(deadline)), np.uint64(status.data_ptr()))
        self._launch("flags.cu", "gpucomm_wait", 1, args)
        return _missing(status, epoch)

    def run_program(
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
    ) -> None:
        """One launch of ``kernels/cuda/program.cu``: ``channels`` blocks on torch's current stream;
        ``all_channels`` (default ``channels``) is how many the flag layout has, whose epochs the
        launch keeps in step.

        The arguments mean what they mean for ``TritonKernels.run_program``
        (:mod:`gpucomm.device_executor` describes them). ``copy_bytes`` and ``aligned`` are
        accepted for that common signature and not needed: the CUDA kernel picks its access width
        from each range's own addresses, so a misaligned access (a fatal CUDA error) cannot happen,
        and the aligned parts of an otherwise unaligned program still move 16-byte vectors.

        Nothing here waits for the device or allocates: a CUDA graph can capture the launch.
        """
        all_channels = channels if all_channels is None else all_channels
        kernel = _check_program(
            self._device, instructions, operands, peers, state_addr, record_addr, channels, rank, world,
            fingerprint, half_bytes, granule, timeout_ns, dtype, op, all_channels,
        )
        args = (
            np.uint64(instructions.data_ptr()), np.int64(instructions.numel() // WORDS),
            np.uint64(operands.data_ptr()), np.uint64(peers.data_ptr()), np.uint64(state_addr),
            np.uint64(record_addr), np.int32(rank), np.int32(world), np.int64(fingerprint),
            np.int64(half_bytes), np.int64(granule), np.uint64(timeout_ns), np.int32(all_channels),
        )
        self._launch("program.cu", kernel, channels, args)

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
        """A device int64 tensor holding ``addrs`` (cached: tables repeat call after call)."""
        key = tuple(addrs)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) >= _MAX_TABLES:
                self._tables.clear()
            table = torch.tensor(addrs, dtype=torch.int64).to(self._device)
            self._tables[key] = table
        return table

    def _status(self, n: int, epoch: int) -> torch.Tensor:
        """A fresh error record {0, epoch, ..., epoch} (see wait_flags_block in common.cuh)."""
        return torch.tensor([0] + [epoch] * n, dtype=torch.int64).to(self._device)

    def _launch(self, file: str, kernel: str, blocks: int, args: tuple) -> None:
        function = self._function(file, kernel)
        torch_stream = torch.cuda.current_stream(self._device)
        stream = self._streams.get(torch_stream.cuda_stream)
        if stream is None:
            stream = self._cupy_stream(torch_stream)
            self._streams[torch_stream.cuda_stream] = stream
        with self._cupy.cuda.Device(self._device.index):
            function((blocks,), (THREADS,), args, stream=stream)

    def _cupy_stream(self, torch_stream: torch.cuda.Stream) -> Any:
        stream_cls = self._cupy.cuda.Stream
        # CuPy 14 deprecates ExternalStream for Stream.from_external (the CUDA stream protocol).
        if hasattr(stream_cls, "from_external") and hasattr(torch_stream, "__cuda_stream__"):
            return stream_cls.from_external(torch_stream)
        return self._cupy.cuda.ExternalStream(torch_stream.cuda_stream, self._device.index)

    def _function(self, file: str, kernel: str) -> Any:
        key = (file, kernel)
        function = self._functions.get(key)
        if function is None:
            function = self._module(file, _DEFINES).get_function(kernel)
            self._functions[key] = function
        return function

    def _module(self, file: str, defines: Mapping[str, object]) -> Any:
        key = (file, tuple(sorted((k, str(v)) for k, v in defines.items())), self._arch)
        module = self._modules.get(key)
        if module is None:
            binary = self._compile(file, defines)
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
