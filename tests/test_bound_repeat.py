"""A repeated all_reduce on the device path launches its bound kernel with one call into the driver:
never Triton's JIT dispatch, never a compiled kernel's own launcher, never a new binding.

Two ranks on CPU tensors with the host-only Triton kernels (the program kernel compiled for sm_90
and bound through gpucomm's launcher on the driver double, as bench/host_time.py times it): the
double records each launch and runs nothing, so the calls' results are not checked here (the
interpreter tests check them); what is checked is what reaches the driver.
"""

from __future__ import annotations

import pathlib
import time

import pytest

import cuda_double
from spawn import run_ranks

from gpucomm import native

pytestmark = pytest.mark.skipif(native.load("launch") is None, reason="gpucomm's launcher cannot be built here (no C compiler)")

# The real compiler (for sm_90), not the interpreter.
ENV = {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
REPEATS = 20


def _refuse(what: str):  # noqa: ANN202
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a repeated call entered {what}")

    return refused


def _repeated(rank: int, world_size: int, double: str, log_dir: str) -> dict:
    import torch
    import triton.compiler.compiler as compiler
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    import gpucomm
    from gpucomm.ops import launcher, registry, triton_launch
    from gpucomm.ops.triton_ops import HostOnlyTritonKernels

    registry.install("triton", "cpu", HostOnlyTritonKernels(GPUTarget("cuda", 90, 32), double))
    gpucomm.init_process_group(transport="shm", kernels="triton", timeout=60)
    t = torch.ones(2)  # 8 bytes
    gpucomm.all_reduce(t)  # compiles, binds
    gpucomm.all_reduce(t)  # learned by the fast path
    # From here on nothing may dispatch, compile or bind: only the bound launch reaches the driver.
    JITFunction.run = _refuse("JITFunction.run")
    compiler.CompiledKernel.run = property(_refuse("CompiledKernel.run"))
    compiler.CompiledKernel.__getitem__ = _refuse("CompiledKernel.__getitem__")
    triton_launch.compile_for = _refuse("compile_for")
    triton_launch.bind = _refuse("triton_launch.bind")
    launcher.bind = _refuse("launcher.bind")
    log = f"{log_dir}/rank{rank}.log"
    cuda_double.log_to(double, log)
    before = cuda_double.launches(double)
    for _ in range(REPEATS):
        gpucomm.all_reduce(t)
    launched = cuda_double.launches(double) - before
    cuda_double.log_to(double, None)
    # No kernel runs on the double, so no collective waits for the peer: wait for it here before
    # the workspace is torn down (it may still be opening it).
    pathlib.Path(log_dir, f"done.{rank}").touch()
    deadline = time.monotonic() + 120
    while not all(pathlib.Path(log_dir, f"done.{r}").exists() for r in range(world_size)) and time.monotonic() < deadline:
        time.sleep(0.01)
    gpucomm.destroy_process_group()
    return {"launched": launched, "records": cuda_double.records(log, "cuLaunchKernel")}


def test_a_repeated_call_is_one_bound_launch_and_enters_no_dispatch(tmp_path) -> None:
    double = cuda_double.build()
    for result in run_ranks(_repeated, 2, double, str(tmp_path), env=ENV, timeout=300):
        records = result["records"]
        assert result["launched"] == REPEATS == len(records)
        assert {r["name"] for r in records} == {"program_kernel"}
        # One binding, launched as it was packed, on the caller's stream (the null stream on CPU).
        assert len({r["params"] for r in records}) == 1
        assert {(r["grid"], r["block"], r["stream"], r["form"]) for r in records} == {("1,1,1", "256,1,1", "0", "buffer")}
