"""Where gpucomm's launcher cannot be built (``GPUCOMM_NATIVE=0``, no C compiler), the Triton kernels
launch through Triton's compiled kernel: the program kernel and the small all_reduce alike are
compiled for, and launched on, their instance's GPU whatever device the calling thread has current.

No GPU here: the device guard and Triton's warmup are stood in for, and record which device was
current when each step ran."""

from __future__ import annotations

import contextlib

import torch

from gpucomm.ops import triton_launch, triton_ops
from gpucomm.ops.launch_args import SmallArgs
from gpucomm.reduce_op import ReduceOp

GPU = torch.device("cuda", 1)  # the instance's GPU; the caller's thread has another one current


class _Compiled:
    """What Triton's warmup returns, as much of it as CompiledLaunch reads: its run records the
    device current at the launch."""

    def __init__(self, current: list) -> None:
        self.function, self.packed_metadata = 0xF0, object()
        self.launched_on: list = []
        self._current = current

    def run(self, *args: object) -> None:
        self.launched_on.append(self._current[-1] if self._current else None)


def test_the_small_launch_without_gpucomms_launcher_compiles_and_launches_on_its_own_gpu(monkeypatch) -> None:
    current: list = []

    @contextlib.contextmanager
    def on_device(device: torch.device):  # noqa: ANN202
        current.append(device)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(triton_ops, "on_device", on_device)
    monkeypatch.setattr(triton_launch, "on_device", on_device)
    compiled = _Compiled(current)
    warmed_on: list = []

    def warmup(*args: object, **kwargs: object) -> _Compiled:
        warmed_on.append(current[-1] if current else None)
        return compiled

    monkeypatch.setattr(triton_ops.small_kernel.small_kernel, "warmup", warmup)
    kernels = triton_ops.TritonKernels.__new__(triton_ops.TritonKernels)
    kernels.device = GPU
    monkeypatch.setattr(kernels, "_driver", lambda: None, raising=False)
    args = SmallArgs(
        x=0x1000,
        n=2,
        stages=(0x2000, 0x3000),
        flags=(0x4000, 0x5000),
        half_bytes=1 << 20,
        state_addr=0x6000,
        record_addr=0x7000,
        rank=0,
        fingerprint=1,
        timeout_ns=10**9,
        channels=1,
        all_channels=4,
        divisor=2,
        dtype=torch.float32,
        op=ReduceOp.SUM,
    )
    launch = kernels.prepare_small(args)
    launch.launch(0xABC)
    assert warmed_on == [GPU] and compiled.launched_on == [GPU]
