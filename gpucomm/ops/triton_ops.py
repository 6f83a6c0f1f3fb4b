"""``TritonKernels``: the kernel contract on :class:`Region` s, launched as Triton kernels.

Regions become int64 address tables on the data's device; the kernels in ``kernels/triton``
(installed as ``gpucomm._kernels.triton``) cast them to pointers, so any region may be a peer's
memory. Every launch runs with this instance's device current (:mod:`gpucomm.ops.device_guard`):
Triton's JIT launches on torch's current device, which the calling thread may have set to
another. On CPU tensors this runs only under the Triton interpreter (``TRITON_INTERPRET=1`` set
before triton is imported), which is how CI runs the GPU data path.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from gpucomm._kernels.triton import copy as copy_kernel
from gpucomm._kernels.triton import flags as flag_kernels
from gpucomm._kernels.triton import program as program_kernel
from gpucomm._kernels.triton import reduce as reduce_kernel
from gpucomm._kernels.triton import small as small_kernel
from gpucomm.errors import UnsupportedError
from gpucomm.ops import launcher, triton_launch
from gpucomm.ops._validate import check_copy, check_epoch, check_flags, check_reduce
from gpucomm.ops.contract import Region
from gpucomm.ops.device_guard import on_device
from gpucomm.ops.launch_args import MAX_SMALL_WORLD, ProgramArgs, SmallArgs
from gpucomm.ops.tables import held
from gpucomm.reduce_op import ReduceOp

__all__ = ["TritonKernels", "HostOnlyTritonKernels", "JitDispatchTritonKernels"]

# Address tables are tiny but cost a host-to-device copy; a workspace reuses the same few, so
# they are kept (bounded: pieces of large tensors and user buffers bring new addresses).
_TABLE_CACHE_SIZE = 1024

# The wait kernel polls a bounded number of times per launch, then the host checks the clock.
# A round should take about _ROUND_S: long enough that launches are rare, short enough that a
# wait returns soon after its deadline. One poll costs ~1 us on a GPU and ~0.5 ms under the
# interpreter (measured), so the budget adapts to the measured duration of each round.
_ROUND_S = 0.02
_MIN_SPINS = 4
_MAX_SPINS = 1 << 20


class TritonKernels:
    """The kernel contract (:class:`gpucomm.ops.Kernels`) as Triton kernels on ``device``.

    Example::

        >>> k = TritonKernels(torch.device("cuda"))  # doctest: +SKIP
        >>> k.reduce(Region.of(out), [Region.of(a), Region.of(b)], torch.float16, ReduceOp.SUM)  # doctest: +SKIP
    """

    name = "triton"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}
        self._spins = _MIN_SPINS

    def _table(self, addrs: Sequence[int]) -> torch.Tensor:
        key = tuple(addrs)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) >= _TABLE_CACHE_SIZE:
                self._tables.clear()
            table = torch.tensor(key, dtype=torch.int64, device=self.device)
            self._tables[key] = table
        return held(table)  # by the current stream, which the launch that reads it goes on

    def _launch(self, kernel: Any, *args: object) -> None:
        """``kernel(*args)`` (a launch through Triton's JIT) with this instance's device current."""
        with on_device(self.device):
            kernel(*args)

    def _check_device(self, fn: str, region: Region) -> None:
        if region.device.type != self.device.type:
            raise ValueError(f"{fn}: region on {region.device}, expected {self.device} (this TritonKernels' device)")

    def copy(self, dst: Region, src: Region) -> None:
        check_copy(dst, src)
        self._check_device("copy", dst)
        elem = copy_kernel.element_bytes(dst.addr, src.addr, dst.nbytes)
        aligned = (dst.addr | src.addr) % 16 == 0
        self._launch(copy_kernel.copy, self._table([dst.addr, src.addr]), elem, dst.nbytes, aligned)

    def reduce(
        self,
        out: Region,
        srcs: Sequence[Region],
        dtype: torch.dtype,
        op: ReduceOp,
        divisor: int = 1,
    ) -> None:
        op = check_reduce(out, srcs, dtype, op, divisor)
        self._check_device("reduce", out)
        n = out.nbytes // dtype.itemsize
        addrs = [out.addr, *(s.addr for s in srcs)]
        aligned = all(a % 16 == 0 for a in addrs)
        self._launch(reduce_kernel.reduce, self._table(addrs), n, dtype, int(op), divisor, aligned)

    def signal(self, flags: Sequence[Region], epoch: int) -> None:
        check_flags("signal", flags)
        check_epoch("signal", epoch)
        if flags:
            self._check_device("signal", flags[0])
            self._launch(flag_kernels.signal, self._table([f.addr for f in flags]), epoch)

    def wait(self, flags: Sequence[Region], epoch: int, deadline: float) -> list[int]:
        check_flags("wait", flags)
        check_epoch("wait", epoch)
        if not flags:
            return []
        self._check_device("wait", flags[0])
        table = self._table([f.addr for f in flags])
        status = torch.empty(len(flags), dtype=torch.int64, device=self.device)
        while True:
            start = time.monotonic()
            self._launch(flag_kernels.wait, table, status, epoch, self._spins)
            seen = status.tolist()  # waits for the kernel
            missing = [i for i, value in enumerate(seen) if value < epoch]
            now = time.monotonic()
            if not missing or now >= deadline:
                return missing
            # The round ran its whole budget: steer the budget towards rounds of _ROUND_S.
            if now - start < _ROUND_S / 2:
                self._spins = min(self._spins * 2, _MAX_SPINS)
            elif now - start > _ROUND_S * 2:
                self._spins = max(self._spins // 2, _MIN_SPINS)

    def run_program(self, args: ProgramArgs) -> None:
        """One launch of the program kernel (:meth:`prepare_program`), on the current stream."""
        prepared = self.prepare_program(args)
        if self.device.type == "cuda":
            self._launch(prepared.launch, torch.cuda.current_stream(self.device).cuda_stream)
        else:
            prepared()

    def prepare_program(self, args: ProgramArgs) -> Any:
        """The launch of the program kernel that ``args`` describe, checked and packed once.

        On a GPU: the kernel compiled for this specialisation (once) and its launch bound through
        gpucomm's launcher (:mod:`gpucomm.ops.triton_launch`); ``launch(stream)`` of the result is
        one call into the driver. Under the interpreter (CPU): calling the result runs it.

        Raises:
            ValueError: the instruction table is not on this instance's device.
        """
        instructions = args.instructions
        if instructions.device.type != self.device.type:  # the table's device, not a Region built to ask
            raise ValueError(
                f"run_program: instructions on {instructions.device}, expected {self.device} "
                f"(this TritonKernels' device)"
            )
        if self.device.type == "cpu" and self._bound_on is None:  # the interpreter
            return program_kernel.prepare(args)
        return self._bind(program_kernel.program_kernel, *program_kernel.arguments(args))

    def prepare_small(self, args: SmallArgs) -> Any:
        """The launch of ``kernels/triton/small.py``'s all_reduce that ``args`` describe, packed
        once, as :meth:`prepare_program` packs the program kernel's: on a GPU bound through
        gpucomm's launcher (``launch(stream)``), under the interpreter a callable that runs it.

        Raises:
            ValueError: more ranks than the kernel takes, or not one flag area per rank.
        """
        if not 1 <= len(args.stages) <= MAX_SMALL_WORLD or len(args.flags) != len(args.stages):
            raise ValueError(
                f"prepare_small: 1 to {MAX_SMALL_WORLD} ranks, one half and one flag area each, got "
                f"{len(args.stages)} halves and {len(args.flags)} flag areas"
            )
        if self.device.type == "cpu" and self._bound_on is None:  # the interpreter
            return small_kernel.prepare(args)
        return self._bind(small_kernel.small_kernel, *small_kernel.arguments(args))

    def _bind(
        self,
        kernel: Any,
        grid: tuple[int],
        values: tuple,
        constexprs: dict,
        options: dict,
    ) -> Any:
        """``kernel`` compiled for these arguments and its launch bound through gpucomm's launcher;
        where the launcher cannot be built (GPUCOMM_NATIVE=0), Triton's compiled kernel's launch,
        compiled for and launched on this instance's device whatever device the caller has current."""
        drv = self._driver()
        if drv is None:
            with on_device(self.device):  # warmup compiles for, and loads into, the current device
                compiled = kernel.warmup(*values, grid=grid, **constexprs, **options)
            return triton_launch.CompiledLaunch(compiled, grid, [*values, *constexprs.values()], self.device)
        compiled = triton_launch.compile_for(kernel, self._target(), values, constexprs, options)
        named = dict(zip(kernel.arg_names, values))
        return triton_launch.bind(compiled, drv, self._device_index(), grid, named)

    # -- where the program kernel is compiled for and launched through ----------------------------
    _bound_on: str | None = None  # HostOnlyTritonKernels: the driver (double) its launches go to

    def _target(self) -> Any:
        """The GPU this instance compiles for: its own device's (Triton asks the current one)."""
        from triton.runtime import driver

        with on_device(self.device):
            return driver.active.get_current_target()

    def _driver(self) -> Any:
        return launcher.driver(None)

    def _device_index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()


class HostOnlyTritonKernels(TritonKernels):
    """Tests and benchmarks only: the program kernel compiled for ``target`` (a
    ``triton.backends.compiler.GPUTarget``, no GPU needed) and bound through gpucomm's launcher on
    the driver at ``driver_path`` (the tests' driver double), for CPU tensors. Nothing runs on a
    device: a launch reaches the driver and stops there, so what this measures or checks is the
    host's side of a launch (its cost, its parameters), never a collective's result.

    Never chosen by a kernels name: a test or benchmark installs it
    (:func:`gpucomm.ops.registry.install`) in a process it owns. Only the program kernel is served
    (the device executor runs every collective in it); the contract's other kernels raise.
    """

    def __init__(self, target: Any, driver_path: str, device_index: int = 0) -> None:
        super().__init__(torch.device("cpu"))
        self._bound_on = driver_path
        self._gpu_target = target
        self._gpu_index = device_index  # the double's GPU the launches are bound for

    def _target(self) -> Any:
        return self._gpu_target

    def _driver(self) -> Any:
        return launcher.driver(self._bound_on)

    def _device_index(self) -> int:
        return self._gpu_index

    def copy(self, dst: Region, src: Region) -> None:
        raise UnsupportedError("HostOnlyTritonKernels: only the program kernel is served (copy is not)")

    def reduce(self, out: Region, srcs: Sequence[Region], dtype: torch.dtype, op: ReduceOp, divisor: int = 1) -> None:
        raise UnsupportedError("HostOnlyTritonKernels: only the program kernel is served (reduce is not)")

    def signal(self, flags: Sequence[Region], epoch: int) -> None:
        raise UnsupportedError("HostOnlyTritonKernels: only the program kernel is served (signal is not)")

    def wait(self, flags: Sequence[Region], epoch: int, deadline: float) -> list[int]:
        raise UnsupportedError("HostOnlyTritonKernels: only the program kernel is served (wait is not)")


class JitDispatchTritonKernels(TritonKernels):
    """Benchmarks only: the program kernel launched through Triton's JIT dispatch on every call (what
    served before gpucomm's launcher), for bench/gpu_latency.py to measure beside the bound launch.
    Never chosen by a kernels name; a benchmark installs it (:func:`gpucomm.ops.registry.install`)."""

    def prepare_program(self, args: ProgramArgs) -> Any:
        if self.device.type != "cuda":
            raise UnsupportedError("JitDispatchTritonKernels: the JIT dispatch it measures runs on a CUDA device")
        return _OnCurrentStream(program_kernel.prepare(args))


class _OnCurrentStream:
    """``launch(stream)`` of a launch that goes on torch's current stream by itself (the JIT dispatch
    asks torch for it): the caller's current stream is the one named."""

    def __init__(self, launch: Any) -> None:
        self._launch = launch

    def launch(self, stream: int) -> None:
        self._launch()
