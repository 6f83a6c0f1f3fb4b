"""``EmulatedCudaKernels``: the kernel contract on CPU tensors with the CUDA C++ kernels built for the host.

With ``GPUCOMM_CUDA_EMULATE=1``, ``GPUCOMM_KERNELS=cuda`` serves CPU tensors (the shared-memory
workspace) as ``TRITON_INTERPRET=1`` makes ``GPUCOMM_KERNELS=triton`` serve them: the device
executor's programs run ``kernels/cuda/program.cu``, the small all_reduce ``small.cu``, and the
contract's copy, reduce, signal and wait ``copy.cu``, ``reduce.cu`` and ``flags.cu``, each the
unchanged source built by g++ (:mod:`gpucomm.ops.cuda_host`) and run block after block, every
GPU thread a fiber with real block barriers, every flag a real atomic of the declared order. The
arguments are packed as for a GPU (:mod:`gpucomm.ops.cuda_params`), checked by the same checks.

A launch runs to its end before it returns, as the Triton interpreter's do; its waits are the
kernels' own, bounded by their deadlines on the host's monotonic clock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from gpucomm.config import cuda_emulation
from gpucomm.ops import cuda_host
from gpucomm.ops._validate import check_copy, check_epoch, check_flags, check_reduce
from gpucomm.ops.contract import Region
from gpucomm.ops.cuda_params import (
    COPY_PARAMS,
    REDUCE_PARAMS,
    SIGNAL_PARAMS,
    WAIT_PARAMS,
    check_program,
    check_small,
    program_params,
    small_params,
)
from gpucomm.ops.cuda_source import reduce_kernel_name, small_kernel_name
from gpucomm.ops.launch_args import ProgramArgs, SmallArgs
from gpucomm.ops.launcher import Param
from gpucomm.reduce_op import ReduceOp

__all__ = ["EmulatedCudaKernels"]

# Blocks of a grid-stride kernel (copy, reduce) at most: they run one after the other here, and a
# few exercise the grid-stride loops as a GPU's many do.
_MAX_BLOCKS = 4
_CPU = torch.device("cpu")


class EmulatedCudaKernels:
    """The kernel contract (:class:`gpucomm.ops.Kernels`) on CPU memory with the host-built CUDA C++ kernels.

    Args:
        threads: threads per block (default ``GPUCOMM_CUDA_EMULATE_THREADS``, 512): the
            ``GPUCOMM_THREADS`` of the build and the block size of every launch.
        seed: the blocks' order (default ``GPUCOMM_CUDA_EMULATE_SEED``); the same on every rank.

    Example::

        >>> k = EmulatedCudaKernels(threads=64)  # doctest: +SKIP
        >>> k.reduce(Region.of(out), [Region.of(a), Region.of(b)], torch.float32, ReduceOp.SUM)  # doctest: +SKIP
    """

    name = "cuda"
    label = "cuda (emulated)"  # what GPUCOMM_DEBUG=INFO says
    device = _CPU

    def __init__(self, threads: int | None = None, seed: int | None = None) -> None:
        setting = cuda_emulation()
        self.threads = setting.threads if threads is None else threads
        self.seed = setting.seed if seed is None else seed
        self._defines = {"GPUCOMM_THREADS": self.threads}

    def library(self, file: str) -> str:
        """The path of ``file`` built for this instance's threads (:func:`gpucomm.ops.cuda_host.library`)."""
        return cuda_host.library(file, self._defines)

    def _launch(self, file: str, kernel: str, blocks: int, params: Sequence[Param], keep: object = None) -> _Launch:
        return _Launch(cuda_host.HostLaunch(self.library(file), kernel, blocks, self.threads, params, self.seed), keep)

    def _blocks(self, nbytes: int) -> int:
        return max(1, min(_MAX_BLOCKS, -(-nbytes // (16 * self.threads))))

    # -- the contract --------------------------------------------------------------------------

    def copy(self, dst: Region, src: Region) -> None:
        check_copy(dst, src)
        self._check_cpu("copy", [dst, src])
        if dst.nbytes == 0:
            return
        values = (dst.addr, src.addr, dst.nbytes)
        self._launch("copy.cu", "gpucomm_copy", self._blocks(dst.nbytes), _params(COPY_PARAMS, values))()

    def reduce(self, out: Region, srcs: Sequence[Region], dtype: torch.dtype, op: ReduceOp, divisor: int = 1) -> None:
        op = check_reduce(out, srcs, dtype, op, divisor)
        self._check_cpu("reduce", [out, *srcs])
        n = out.nbytes // dtype.itemsize
        if n == 0:
            return
        table = torch.tensor([s.addr for s in srcs], dtype=torch.int64)
        values = (out.addr, table.data_ptr(), len(srcs), n, divisor)
        kernel = reduce_kernel_name(dtype, op)
        self._launch("reduce.cu", kernel, self._blocks(out.nbytes), _params(REDUCE_PARAMS, values), table)()

    def signal(self, flags: Sequence[Region], epoch: int) -> None:
        check_flags("signal", flags)
        check_epoch("signal", epoch)
        self._check_cpu("signal", flags)
        if not flags:
            return
        table = torch.tensor([f.addr for f in flags], dtype=torch.int64)
        values = (table.data_ptr(), len(flags), epoch)
        self._launch("flags.cu", "gpucomm_signal", 1, _params(SIGNAL_PARAMS, values), table)()

    def wait(self, flags: Sequence[Region], epoch: int, deadline: float) -> list[int]:
        """Indices of the flags still below ``epoch`` at the deadline (``time.monotonic()``); [] if none."""
        check_flags("wait", flags)
        check_epoch("wait", epoch)
        self._check_cpu("wait", flags)
        if not flags:
            return []
        self.library("flags.cu")  # built before the clock starts: a first build is no part of the wait
        table = torch.tensor([f.addr for f in flags], dtype=torch.int64)
        status = torch.tensor([0] + [epoch] * len(flags), dtype=torch.int64)
        timeout_ns = min(max(0, round((deadline - time.monotonic()) * 1e9)), 2**64 - 1)
        values = (table.data_ptr(), len(flags), epoch, timeout_ns, status.data_ptr())
        self._launch("flags.cu", "gpucomm_wait", 1, _params(WAIT_PARAMS, values), table)()
        record = status.tolist()
        if record[0] == 0:
            return []
        return [i for i, seen in enumerate(record[1:]) if seen < epoch]

    def prepare_program(self, args: ProgramArgs) -> _Launch:
        """The launch of ``kernels/cuda/program.cu`` that ``args`` describe, checked and packed once,
        as :meth:`gpucomm.ops.cuda_ops.CudaKernels.prepare_program` packs it: calling the result (or
        its ``launch(stream)``) runs it. It holds ``args`` (the tables it reads)."""
        kernel = check_program(_CPU, args)
        return self._launch("program.cu", kernel, args.channels, program_params(args), args)

    def run_program(self, args: ProgramArgs) -> None:
        self.prepare_program(args)()

    def prepare_small(self, args: SmallArgs) -> _Launch:
        """The launch of ``kernels/cuda/small.cu``'s all_reduce that ``args`` describe, packed once."""
        check_small(args)
        kernel = small_kernel_name(args.dtype, ReduceOp(args.op))
        return self._launch("small.cu", kernel, args.channels, small_params(args), args)

    def _check_cpu(self, fn: str, regions: Sequence[Region]) -> None:
        for region in regions:
            if region.device.type != "cpu":
                raise ValueError(
                    f"EmulatedCudaKernels.{fn}: expected regions of CPU memory, got one on {region.device}"
                )


class _Launch:
    """A host launch and what it reads (its tables), kept alive together."""

    __slots__ = ("_run", "_keep", "launch")

    def __init__(self, run: cuda_host.HostLaunch, keep: object) -> None:
        self._run = run
        self._keep = keep
        self.launch = run.launch  # launch(stream): the stream is the host's own order

    def __call__(self) -> None:
        self._run()


def _params(spec: Sequence[tuple[str, int]], values: Sequence[int]) -> list[Param]:
    return [Param(name, size, value) for (name, size), value in zip(spec, values, strict=True)]
