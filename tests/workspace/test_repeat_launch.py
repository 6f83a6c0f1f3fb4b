"""A repeated all_reduce on the device path launches its bound kernel with one call into the driver:
never Triton's JIT dispatch, never a compiled kernel's own launcher, never a new binding. Captured
into a CUDA graph, a call is the same bound launch on the capturing stream (the executor's GPU
branch driven on the CPU device: the caller's stream handle and whether it captures are given to
it as torch would on a GPU), and the graph replays it.

Two ranks on CPU tensors with the host-only Triton kernels (the program kernel compiled for sm_90
and bound through gpucomm's launcher on the driver double, as bench/host_time.py times it): the
double records each launch and runs nothing, so the calls' results are not checked here (the
interpreter tests check them); what is checked is what reaches the driver.
"""

from __future__ import annotations

import gc
import pathlib
import time
import weakref

import cuda_double
import pytest
from spawn import run_ranks

from gpucomm.toolchain import native

pytestmark = pytest.mark.skipif(
    native.load("launch") is None, reason="gpucomm's launcher cannot be built here (no C compiler)"
)

# The real compiler (for sm_90), not the interpreter.
ENV = {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
REPEATS = 20


def _refuse(what: str):  # noqa: ANN202
    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a repeated call entered {what}")

    return refused


def _wait_for_peers(log_dir: str, rank: int, world_size: int) -> None:
    """No kernel runs on the double, so no collective waits for the peer: wait for it here before
    the workspace is torn down (it may still be opening it)."""
    pathlib.Path(log_dir, f"done.{rank}").touch()
    deadline = time.monotonic() + 120
    while (
        not all(pathlib.Path(log_dir, f"done.{r}").exists() for r in range(world_size)) and time.monotonic() < deadline
    ):
        time.sleep(0.01)


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
    _wait_for_peers(log_dir, rank, world_size)
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
        assert {(r["grid"], r["block"], r["stream"], r["form"]) for r in records} == {
            ("1,1,1", "256,1,1", "0", "buffer")
        }


class _CallerStream:
    """The caller's stream order as the executor sees it on a GPU (gpucomm.workspace.stream_order): nothing
    to wait for, except that it returns False while the caller's stream captures a graph."""

    def __init__(self) -> None:
        self.capturing = False

    def to_caller(self) -> bool:
        return not self.capturing


def _captured(rank: int, world_size: int, double: str, log_dir: str) -> dict:
    import contextlib
    import ctypes

    import torch
    from triton.backends.compiler import GPUTarget

    import gpucomm
    import gpucomm.workspace.device_executor as device_executor
    from gpucomm.ops import registry
    from gpucomm.ops.triton_ops import HostOnlyTritonKernels

    eager_stream, capture_stream, replay_stream = 0xE1, 0xC0, 0xF2
    registry.install("triton", "cpu", HostOnlyTritonKernels(GPUTarget("cuda", 90, 32), double))
    gpucomm.init_process_group(transport="shm", kernels="triton", timeout=60)
    # The executor's GPU branch on the CPU device: launches name the caller's current stream, the
    # stream order says whether it captures, and the device guard has nothing to switch.
    order = _CallerStream()
    stream = [eager_stream]
    engine = gpucomm.get_default_communicator()._engines["cpu"]
    executor = engine.executor
    executor._on_gpu, executor._stream, engine.order = True, lambda: stream[0], order
    device_executor.capturing = lambda device: order.capturing
    torch.cuda.device = lambda device: contextlib.nullcontext()
    torch._C._cuda_getDevice = lambda: executor.device.index  # the executor's device is current
    t = torch.ones(2)
    log = f"{log_dir}/rank{rank}.log"
    cuda_double.log_to(double, log)
    for _ in range(3):  # bound, then learned by the fast path
        gpucomm.all_reduce(t)
    lib = ctypes.CDLL(double)
    graph, exec_ = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cuStreamBeginCapture_v2(ctypes.c_void_p(capture_stream), 0) == 0
    order.capturing, stream[0] = True, capture_stream
    for _ in range(2):
        gpucomm.all_reduce(t)
    order.capturing, stream[0] = False, eager_stream
    assert lib.cuStreamEndCapture(ctypes.c_void_p(capture_stream), ctypes.byref(graph)) == 0
    assert lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0) == 0
    assert lib.cuGraphLaunch(exec_, ctypes.c_void_p(replay_stream)) == 0
    cuda_double.log_to(double, None)
    _wait_for_peers(log_dir, rank, world_size)
    gpucomm.destroy_process_group()
    return {
        "launches": cuda_double.records(log, "cuLaunchKernel"),
        "replays": cuda_double.records(log, "cuGraphLaunch"),
    }


def test_a_captured_call_records_the_same_bound_launch_on_the_capturing_stream(tmp_path) -> None:
    double = cuda_double.build()
    for result in run_ranks(_captured, 2, double, str(tmp_path), env=ENV, timeout=300):
        launches, replays = result["launches"], result["replays"]
        assert [(r["stream"], r["captured"]) for r in launches] == [("0xe1", "0")] * 3 + [("0xc0", "1")] * 2
        assert len({r["params"] for r in launches}) == 1  # the same bound launch, eager and captured
        assert [(r["graph_stream"], r["stream"], r["params"]) for r in replays] == [
            ("0xf2", "0xc0", launches[0]["params"])
        ] * 2


def _evicted(rank: int, world_size: int, double: str, log_dir: str) -> dict:
    import torch
    from triton.backends.compiler import GPUTarget

    import gpucomm
    from gpucomm.ops import registry
    from gpucomm.ops.triton_ops import HostOnlyTritonKernels
    from gpucomm.workspace.device_executor import _BINDINGS

    registry.install("triton", "cpu", HostOnlyTritonKernels(GPUTarget("cuda", 90, 32), double))
    gpucomm.init_process_group(transport="shm", kernels="triton", timeout=60)
    engine = gpucomm.get_default_communicator()._engines["cpu"]
    first = torch.ones(2)
    gpucomm.all_reduce(first)  # compiles, binds
    gpucomm.all_reduce(first)  # learned by the fast path
    (program,) = [p for p in engine._programs.values() if "device" in p.cache]
    bindings = program.cache["device"]["bound"]
    (key,) = bindings
    table = weakref.ref(bindings[key]["operands"])
    others = [torch.ones(2) for _ in range(_BINDINGS)]  # kept: their addresses stay theirs
    for t in others:
        gpucomm.all_reduce(t)  # one binding each: the first one's is dropped
    gc.collect()
    result = {"dropped": key not in bindings, "table_alive": table() is not None}
    cuda_double.log_to(double, f"{log_dir}/rank{rank}.log")
    gpucomm.all_reduce(first)  # the fast path's launch of the dropped binding
    cuda_double.log_to(double, None)
    _wait_for_peers(log_dir, rank, world_size)
    gpucomm.destroy_process_group()
    result["launches"] = len(cuda_double.records(f"{log_dir}/rank{rank}.log", "cuLaunchKernel"))
    return result


def test_a_dropped_binding_lives_while_the_fast_path_launches_it(tmp_path) -> None:
    """More buffers than the executor keeps bindings for: the oldest binding is dropped, but the
    fast path still launches it, so its operand table (whose address the bound launch packed)
    must live on. On a GPU its memory went back to the allocator and the next table took it: the
    launch reduced another buffer (seen on an H100)."""
    double = cuda_double.build()
    for result in run_ranks(_evicted, 2, double, str(tmp_path), env=ENV, timeout=300):
        assert result == {"dropped": True, "table_alive": True, "launches": 1}
