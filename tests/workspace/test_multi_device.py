"""Every launch gpucomm makes for a communicator on device 1 runs in device 1's context while the
calling thread holds device 0's, and the thread holds device 0's again after.

No GPU: the driver double (tests/support/cuda_double) has a node of GPUs (these tests use 0 and 1),
each with its primary context, records with every call the context current at it (``ctx=``), and
refuses a launch of a function whose module was loaded in another context than the current one
(CUDA_ERROR_INVALID_CONTEXT), as the driver does. torch here has no CUDA, so ``torch.cuda.device``
is played on the double (:func:`runtime_device`): ``torch.cuda.device(d)`` makes d's primary
context current and restores the thread's after, which is what cudaSetDevice does to the driver's current context.

What each test reaches, and how:

- the CUDA C++ kernels (``CudaKernels``, the program kernel, copy, reduce, signal, wait): whole,
  to the driver: nvcc's cubins loaded and launched through gpucomm's launcher on the double;
- the Triton program kernel: whole, to the driver: compiled for sm_90 and bound for device 1 by
  ``HostOnlyTritonKernels`` (a worker without TRITON_INTERPRET, as tests/ops/test_program_launch_args.py);
- point-to-point (send and recv through the mailboxes), on either kernel family;
- the multimem set-up (the symmetric heap and its multicast object, gpucomm.transport.vmm):
  whole, to the driver, by two rank processes (tests/transport/test_vmm.py's) through cuda.bindings;
- Triton's JIT launches (``TritonKernels``' copy, reduce, signal, wait; the multimem kernel): up
  to the call into Triton. Triton's JIT is not run (it needs torch's CUDA); in its place each
  kernel module's launch function records the context current when it is called, which is the
  context Triton would load the module into and the device whose stream it would take. Tables
  these launchers allocate "on cuda:1" are CPU tensors (:func:`cpu_backed`);
- the device API's launches (``DeviceContext.launch``, the engine's one-shot written with it) and
  the device executor's launch of a bound program: their guard, on stand-ins for the objects (a
  context, an engine and an executor on GPU 1 take a GPU to build);
- whether a CUDA graph is being captured, asked of GPU 1's stream (gpucomm.capture, the stream
  order of the host's fast path), with torch's two C calls played on the double.

Not reached here: a whole engine or communicator on GPU 1 (its allocations, streams and events
name their device: torch's guard, not gpucomm's).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
import types

import cuda_double
import pytest
import torch

ONE = torch.device("cuda", 1)


# -- the driver double as the thread's CUDA runtime ---------------------------------------------
class Contexts:
    """The double's contexts, from this thread (the same library the launcher opened)."""

    def __init__(self, library: str) -> None:
        self.lib = ctypes.CDLL(library)
        assert self.lib.cuInit(0) == 0

    def primary(self, device: int) -> ctypes.c_void_p:
        context = ctypes.c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
        return context

    def current(self) -> ctypes.c_void_p:
        context = ctypes.c_void_p()
        assert self.lib.cuCtxGetCurrent(ctypes.byref(context)) == 0
        return context

    def set(self, context: ctypes.c_void_p) -> None:
        assert self.lib.cuCtxSetCurrent(context) == 0

    def device(self) -> int:
        """The current context's device (-1: none)."""
        if not self.current().value:
            return -1
        device = ctypes.c_int()
        assert self.lib.cuCtxGetDevice(ctypes.byref(device)) == 0
        return device.value


def runtime_device(contexts: Contexts) -> type:
    """``torch.cuda.device`` as the CUDA runtime plays it on the driver: ``d``'s primary context
    current inside (cudaSetDevice), the thread's own back after."""

    class RuntimeDevice:
        def __init__(self, device: torch.device | int) -> None:
            self.index = device.index if isinstance(device, torch.device) else int(device)

        def __enter__(self) -> None:
            self.previous = contexts.current()
            contexts.set(contexts.primary(self.index))

        def __exit__(self, *exc: object) -> None:
            contexts.set(self.previous)

    return RuntimeDevice


@pytest.fixture
def double(tmp_path, monkeypatch):  # noqa: ANN201
    """(library, log, contexts): the double recording into ``log``, torch.cuda.device played on
    it, and device 0's context current in this thread, as a caller on GPU 0 holds it."""
    library, log = cuda_double.build(), tmp_path / "calls.log"
    contexts = Contexts(library)
    monkeypatch.setattr(torch.cuda, "device", runtime_device(contexts))
    before = contexts.current()
    contexts.set(contexts.primary(0))
    cuda_double.log_to(library, log)
    try:
        yield library, log, contexts
    finally:
        cuda_double.log_to(library, None)
        contexts.set(before)


def cpu_backed(monkeypatch, *modules: types.ModuleType) -> None:
    """torch in ``modules`` allocating "cuda" tensors in host memory (no CUDA here): the seam
    that lets their launchers run up to the launch."""

    def on_host(factory):  # noqa: ANN001, ANN202
        def make(*args, device=None, pin_memory=False, **kwargs):  # noqa: ANN002, ANN003, ANN202
            return factory(*args, **kwargs)

        return make

    fake = types.SimpleNamespace(**{name: getattr(torch, name) for name in dir(torch) if not name.startswith("__")})
    fake.tensor, fake.empty, fake.zeros = on_host(torch.tensor), on_host(torch.empty), on_host(torch.zeros)
    for module in modules:
        monkeypatch.setattr(module, "torch", fake)


def contexts_of(log, entries: tuple[str, ...]) -> list[tuple[str, str, str]]:  # noqa: ANN001
    """(entry, kernel name, ctx) of every recorded call of ``entries``."""
    return [(r.entry, r.get("name", ""), r["ctx"]) for r in cuda_double.records(log) if r.entry in entries]


# -- the CUDA C++ kernels, through gpucomm's launcher --------------------------------------------
class GpuBytes:
    """A region's bytes as CudaKernels reads them: on GPU 1 (host memory underneath, which the
    double's kernels never touch and the mailboxes' headers live in)."""

    device = ONE

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __getitem__(self, index: slice) -> GpuBytes:
        return GpuBytes(self.tensor[index])

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        return self.tensor.view(dtype)


def gpu_region(tensor: torch.Tensor):  # noqa: ANN201
    from gpucomm.ops.contract import Region

    return Region(
        tensor.data_ptr(), tensor.numel() * tensor.element_size(), GpuBytes(tensor.view(-1).view(torch.uint8))
    )


def cuda_kernels_on(nvcc_fatbins, library: str, index: int):  # noqa: ANN001, ANN201
    """A CudaKernels as its __init__ leaves it for GPU ``index`` of an sm_90 node, built by hand on
    a host without one: NVRTC's images are nvcc's cubins, the driver the double, the stream a
    made-up handle, the tables in host memory."""
    from gpucomm.ops import launcher
    from gpucomm.ops.cuda_ops import SOURCES, THREADS, CudaKernels

    kernels = CudaKernels.__new__(CudaKernels)
    kernels._device, kernels._index = torch.device("cpu"), index  # tables in host memory
    kernels._arch, kernels._binary_kind, kernels._sm_count = "sm_90", "cubin", 132
    kernels._modules, kernels._functions, kernels._tables, kernels._bound_functions, kernels._layouts = (
        {},
        {},
        {},
        {},
        {},
    )
    defines = (("GPUCOMM_THREADS", str(THREADS)),)
    kernels._images = {(file, defines, "sm_90"): nvcc_fatbins.cubin(file, 90) for file in SOURCES}
    kernels._driver = launcher.driver(library)
    kernels._raw_stream = lambda: 0x1_5EA
    return kernels


def test_cuda_kernels_for_gpu_1_launch_in_its_context_while_gpu_0_is_current(nvcc_fatbins, double) -> None:
    from gpucomm.ops.cuda_ops import reduce_kernel_name
    from gpucomm.ops.launch_args import ProgramArgs
    from gpucomm.reduce_op import ReduceOp

    library, log, contexts = double
    kernels = cuda_kernels_on(nvcc_fatbins, library, 1)
    memory = torch.zeros(4096, dtype=torch.int64)
    out, a, b = (gpu_region(memory[i * 512 : (i + 1) * 512]) for i in range(3))
    flags = [gpu_region(memory[2048 + i : 2049 + i]) for i in range(2)]
    prog, operands, peers = (
        torch.zeros(16, dtype=torch.int64),
        torch.zeros(6, dtype=torch.int64),
        torch.zeros(4, dtype=torch.int64),
    )
    program = kernels.prepare_program(
        ProgramArgs(
            prog,
            operands,
            peers,
            0x7F00_0000_1000,
            0x7F00_0000_2000,
            channels=2,
            rank=1,
            world=2,
            fingerprint=7,
            half_bytes=1 << 20,
            granule=4096,
            timeout_ns=10**9,
            dtype=torch.float32,
            op=0,
            copy_bytes=4,
            aligned=True,
        )
    )
    program.launch(kernels._raw_stream())
    kernels.copy(out, a)
    kernels.reduce(out, [a, b], torch.float32, ReduceOp.SUM)
    kernels.signal(flags, 5)
    assert kernels.wait(flags, 5, time.monotonic() + 30.0) == []
    assert contexts.device() == 0  # the caller's context, as it was

    calls = contexts_of(log, ("cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel"))
    launched = [name for entry, name, _ in calls if entry == "cuLaunchKernel"]
    assert launched == [
        "gpucomm_program_sum_float32",
        "gpucomm_copy",
        reduce_kernel_name(torch.float32, ReduceOp.SUM),
        "gpucomm_signal",
        "gpucomm_wait",
    ]
    assert {ctx for _, _, ctx in calls} == {"1"}, calls
    assert not [r for r in cuda_double.records(log) if r.get("refused") == "1"]


def test_a_launch_from_gpu_0s_context_of_a_gpu_1_function_is_refused_by_the_double(nvcc_fatbins, double) -> None:
    """What the launcher's context switch prevents: the double, like the driver, refuses it."""
    library, _, contexts = double
    kernels = cuda_kernels_on(nvcc_fatbins, library, 1)
    function = kernels._bound_function("copy.cu", "gpucomm_copy")
    lib = contexts.lib
    words, size = (ctypes.c_uint64 * 3)(0, 0, 16), ctypes.c_size_t(24)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(words), 2, ctypes.addressof(size), 0)
    result = lib.cuLaunchKernel(ctypes.c_void_p(function), 1, 1, 1, 32, 1, 1, 0, None, None, extra)
    assert result == 201  # CUDA_ERROR_INVALID_CONTEXT
    contexts.set(contexts.primary(1))
    assert lib.cuLaunchKernel(ctypes.c_void_p(function), 1, 1, 1, 32, 1, 1, 0, None, None, extra) == 0


def test_the_launcher_restores_no_context_where_the_thread_held_none(nvcc_fatbins, double) -> None:
    library, log, contexts = double
    contexts.set(ctypes.c_void_p())
    kernels = cuda_kernels_on(nvcc_fatbins, library, 1)
    kernels.signal([gpu_region(torch.zeros(1, dtype=torch.int64))], 3)
    assert contexts.device() == -1
    assert [ctx for _, _, ctx in contexts_of(log, ("cuLaunchKernel",))] == ["1"]


# -- point-to-point -----------------------------------------------------------------------------
class MailEngine:
    """What the mailboxes read of an engine: rank 0 of 2 on GPU 1's workspace (host memory here)."""

    rank, world_size, members, comm_rank, timeout = 0, 2, [0, 1], 0, 30.0
    device = torch.device("cpu")  # where the headers are written from: host memory here

    def __init__(self, kernels: object) -> None:
        from gpucomm.workspace.layout import FlagLayout

        self.kernels = kernels
        self.p2p_bytes = 1 << 16
        layout = FlagLayout(2, 1)
        self.ready, self.done = layout.p2p_ready, layout.p2p_done
        self.memory = [torch.zeros(self.p2p_bytes // 8, dtype=torch.int64) for _ in range(2)]
        self.flag_words = [torch.zeros(layout.count, dtype=torch.int64) for _ in range(2)]
        self.workspace = self

    def data(self, peer: int, offset: int, nbytes: int):  # noqa: ANN201
        return gpu_region(self.memory[peer]).sub(offset, nbytes)

    def mailbox(self, peer: int, offset: int, nbytes: int):  # noqa: ANN201
        return self.data(peer, offset, nbytes)

    def flag(self, owner: int, index: int):  # noqa: ANN201
        return gpu_region(self.flag_words[owner][index : index + 1])

    def flags(self, owner: int, first: int, count: int):  # noqa: ANN201
        return gpu_region(self.flag_words[owner][first : first + count])


def exchange(engine: MailEngine) -> None:
    """Rank 0 sends 64 bytes to rank 1, and receives the 64 bytes rank 1 posted (its header and
    "data ready" written here by hand: nothing runs rank 1, and the double's kernels move nothing)."""
    from gpucomm.algorithms import p2p

    mail = p2p.Mailboxes(engine, engine.ready, engine.done)
    mail.isend(gpu_region(torch.arange(8, dtype=torch.int64)), 1, tag=3).wait()
    mail._header(1, 0, 0).view(torch.int64).copy_(torch.tensor([4, 64, 0, 64]))
    engine.flag_words[0][engine.ready + 1] = 1
    received = mail.irecv(gpu_region(torch.zeros(8, dtype=torch.int64)), 1, tag=4)
    received.wait()
    assert received.source == 1


def test_send_and_recv_for_gpu_1_launch_in_its_context_with_the_cuda_kernels(nvcc_fatbins, double) -> None:
    library, log, contexts = double
    exchange(MailEngine(cuda_kernels_on(nvcc_fatbins, library, 1)))
    assert contexts.device() == 0
    launched = contexts_of(log, ("cuLaunchKernel",))
    # send: copy in, signal; recv: wait (acquire), copy out, signal "consumed"
    assert [name for _, name, _ in launched] == [
        "gpucomm_copy",
        "gpucomm_signal",
        "gpucomm_wait",
        "gpucomm_copy",
        "gpucomm_signal",
    ]
    assert {ctx for _, _, ctx in launched} == {"1"}


# -- Triton's JIT launches, up to the call into Triton ------------------------------------------
@pytest.fixture
def jit_launches(double, monkeypatch):  # noqa: ANN201
    """[(kernel, device current at its launch)]: each Triton kernel module's launch function
    replaced by one that records the double's current context (what Triton's JIT would launch
    in) and, for the wait, reports every flag at its epoch."""
    from gpucomm._kernels.triton import copy as copy_kernel
    from gpucomm._kernels.triton import flags as flag_kernels
    from gpucomm._kernels.triton import multimem as multimem_kernel
    from gpucomm._kernels.triton import reduce as reduce_kernel

    _, _, contexts = double
    seen: list[tuple[str, int]] = []

    def recorder(name: str, fill: bool = False):  # noqa: ANN202
        def launch(*args: object, **kwargs: object) -> None:
            seen.append((name, contexts.device()))
            if fill:  # wait(addrs, status, epoch, spins)
                args[1].fill_(args[2])

        return launch

    monkeypatch.setattr(copy_kernel, "copy", recorder("copy"))
    monkeypatch.setattr(reduce_kernel, "reduce", recorder("reduce"))
    monkeypatch.setattr(flag_kernels, "signal", recorder("signal"))
    monkeypatch.setattr(flag_kernels, "wait", recorder("wait", fill=True))
    monkeypatch.setattr(multimem_kernel, "launch", recorder("multimem"))
    return seen


def test_triton_kernels_for_gpu_1_launch_with_it_current_while_gpu_0_is_current(
    double, jit_launches, monkeypatch
) -> None:
    from gpucomm.ops import triton_ops
    from gpucomm.reduce_op import ReduceOp

    _, _, contexts = double
    cpu_backed(monkeypatch, triton_ops)
    kernels = triton_ops.TritonKernels(ONE)
    memory = torch.zeros(1024, dtype=torch.int64)
    out, a, b = (gpu_region(memory[i * 128 : (i + 1) * 128]) for i in range(3))
    flags = [gpu_region(memory[512 + i : 513 + i]) for i in range(2)]
    kernels.copy(out, a)
    kernels.reduce(out, [a, b], torch.float32, ReduceOp.SUM)
    kernels.signal(flags, 5)
    assert kernels.wait(flags, 5, time.monotonic() + 30.0) == []
    assert jit_launches == [("copy", 1), ("reduce", 1), ("signal", 1), ("wait", 1)]
    assert contexts.device() == 0


def test_send_and_recv_for_gpu_1_launch_with_it_current_with_the_triton_kernels(
    double, jit_launches, monkeypatch
) -> None:
    from gpucomm.ops import triton_ops

    _, _, contexts = double
    cpu_backed(monkeypatch, triton_ops)
    exchange(MailEngine(triton_ops.TritonKernels(ONE)))
    assert jit_launches == [("copy", 1), ("signal", 1), ("wait", 1), ("copy", 1), ("signal", 1)]
    assert contexts.device() == 0


class SymmetricHeap:
    """What the multimem path reads of a symmetric heap on GPU 1 (host memory here)."""

    device, world_size, rank = ONE, 2, 0

    def __init__(self) -> None:
        self.memory = torch.zeros(1 << 12, dtype=torch.float32)
        self.bases = torch.tensor([self.memory.data_ptr(), self.memory.data_ptr()], dtype=torch.int64)

    def contains(self, tensor: torch.Tensor) -> bool:
        return True

    def offset(self, tensor: torch.Tensor) -> int:
        return tensor.data_ptr() - self.memory.data_ptr()


def test_the_multimem_launch_for_gpu_1_runs_with_it_current_while_gpu_0_is_current(
    double, jit_launches, monkeypatch
) -> None:
    from gpucomm.reduce_op import ReduceOp
    from gpucomm.workspace import multimem

    _, _, contexts = double
    cpu_backed(monkeypatch, multimem)
    heap = SymmetricHeap()
    path = multimem.MultimemAllReduce(heap, 0x7000_0000_0000, "", channels=4, timeout=30.0)
    path.run(heap.memory[:1024], ReduceOp.SUM)
    assert jit_launches == [("multimem", 1)]
    assert contexts.device() == 0


def test_the_device_apis_launches_for_gpu_1_run_with_it_current(double, jit_launches, monkeypatch) -> None:
    """``DeviceContext.launch`` (the fused ops' and users' kernels of gpucomm.language) and the
    engine's one-shot written with it, each called on a stand-in for its object (a context and an
    engine on GPU 1 take a GPU to build)."""
    from gpucomm._kernels.triton import oneshot
    from gpucomm.language.context import DeviceContext
    from gpucomm.reduce_op import ReduceOp
    from gpucomm.workspace.engine import Engine

    _, _, contexts = double
    seen = jit_launches
    context = types.SimpleNamespace(
        device=ONE, check=lambda op="": None, _on_caller_stream=lambda: None, stage_half_bytes=1 << 20
    )
    DeviceContext.launch(context, "my_kernel", lambda: seen.append(("device api", contexts.device())))
    engine = types.SimpleNamespace(
        device=ONE,
        kernels=types.SimpleNamespace(name="triton"),
        device_context=lambda fn: context,
        channels=4,
        world_size=2,
        stream=None,
        order=None,
    )
    monkeypatch.setattr(oneshot, "prepare", lambda *args: lambda: seen.append(("oneshot", contexts.device())))
    Engine._lang_launch(engine, torch.zeros(64), ReduceOp.SUM)()
    assert seen == [("device api", 1), ("oneshot", 1)]
    assert contexts.device() == 0


def test_the_device_executors_launch_for_gpu_1_runs_with_it_current(double, monkeypatch) -> None:
    """A bound program's launch from ``DeviceExecutor.run`` (Triton's own launcher where gpucomm's
    cannot be built launches in the current context), on a stand-in for an executor on GPU 1.
    The executor guarded its launches before the others did: this keeps it so."""
    from gpucomm.workspace import device_executor

    _, _, contexts = double
    monkeypatch.setattr(device_executor, "capturing", lambda device: False)
    seen: list[tuple[int, int]] = []
    launch = lambda stream: seen.append((stream, contexts.device()))  # noqa: E731
    bound = {(0x1000,): {"launch": launch, "captured": False}}
    # One instruction (never read: the binding is there): a program of none is launched nowhere.
    program = types.SimpleNamespace(instructions=[None], cache={"device": {"bound": bound}})
    executor = types.SimpleNamespace(check=lambda: None, device=ONE, _on_gpu=True, _stream=lambda: 0x5EA)
    device_executor.DeviceExecutor.run(executor, program, (0x1000,))
    assert seen == [(0x5EA, 1)]
    assert contexts.device() == 0


def test_the_symmetric_heap_and_its_multicast_object_for_gpu_1_are_set_up_in_its_context(tmp_path) -> None:
    """The multimem path's set-up (gpucomm.transport.vmm: the heap, then the multicast object every
    rank binds it to) for GPU 1, by ranks whose thread holds GPU 0's context (tests/transport/test_vmm.py's
    ranks, each a process on the double)."""
    pytest.importorskip("cuda.bindings", reason="cuda.bindings is the optional vmm extra")
    from vmm_ranks import run_heap_ranks

    outs, calls = run_heap_ranks(tmp_path, "device_one")
    for rank, (code, out, err) in enumerate(outs):
        assert code == 0, f"rank {rank}:\n{err[-4000:]}"
        assert "multicast: made why: " in out and "context after: device 0" in out, out
    driven = [
        c for c in calls if c.entry.startswith(("cuMem", "cuMulticast")) and c.entry != "cuMemGetAllocationGranularity"
    ]
    assert {c.entry for c in driven} >= {
        "cuMemCreate",
        "cuMemMap",
        "cuMemSetAccess",
        "cuMemsetD8",
        "cuMulticastAddDevice",
        "cuMulticastBindMem",
    }
    assert [(c.entry, c["ctx"]) for c in driven if c["ctx"] != "1"] == []
    assert {c["device"] for c in calls if c.entry in ("cuMemCreate", "cuMulticastAddDevice")} == {"1"}


def test_a_capture_on_gpu_1s_stream_is_seen_while_gpu_0_is_current(double, monkeypatch) -> None:
    """Whether to order streams or keep a program for a graph is judged on the communicator's
    device's current stream, not the current device's (torch answers for the latter)."""
    from gpucomm import capture
    from gpucomm.workspace.stream_order import StreamOrder

    _, _, contexts = double
    monkeypatch.setattr(torch._C, "_cuda_getDevice", contexts.device, raising=False)
    monkeypatch.setattr(
        torch._C, "_cuda_isCurrentStreamCapturing", lambda: contexts.device() == 1
    )  # GPU 1's stream captures
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0x5EA, raising=False)
    assert capture.capturing(ONE) and not capture.capturing(torch.device("cuda", 0))
    order = StreamOrder.on(ONE, engine=None)
    assert order.to_caller() is False  # nothing ordered inside the capture
    assert contexts.device() == 0


# -- the Triton program kernel, bound through gpucomm's launcher ---------------------------------
def _worker(library: str, log: str) -> dict:
    from triton.backends.compiler import GPUTarget

    from gpucomm.ops import launcher
    from gpucomm.ops.launch_args import ProgramArgs
    from gpucomm.ops.triton_ops import HostOnlyTritonKernels

    launcher.driver(library)  # cuInit
    contexts = Contexts(library)
    contexts.set(contexts.primary(0))
    cuda_double.log_to(library, log)
    kernels = HostOnlyTritonKernels(GPUTarget("cuda", 90, 32), library, device_index=1)
    prog, operands, peers = (
        torch.zeros(3 * 8, dtype=torch.int64),
        torch.zeros(12, dtype=torch.int64),
        torch.zeros(4, dtype=torch.int64),
    )
    bound = kernels.prepare_program(
        ProgramArgs(
            prog,
            operands,
            peers,
            0x7F12_3456_0008,
            0x7F12_3456_1000,
            channels=2,
            rank=1,
            world=2,
            fingerprint=0xABCDE,
            half_bytes=1 << 20,
            granule=4096,
            timeout_ns=120 * 10**9,
            dtype=torch.float32,
            op=0,
            copy_bytes=8,
            aligned=True,
            all_channels=4,
        )
    )
    bound.launch(0x100)
    bound.launch(0x101)
    return {"after": contexts.device()}


def test_the_triton_program_kernel_for_gpu_1_loads_and_launches_in_its_context(tmp_path) -> None:
    library, log = cuda_double.build(), tmp_path / "calls.log"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's warning; fusion is its default
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", library, str(log)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"after": 0}
    calls = contexts_of(log, ("cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel"))
    assert [(entry, name) for entry, name, _ in calls] == [
        ("cuModuleLoadData", ""),
        ("cuModuleGetFunction", "program_kernel"),
        ("cuLaunchKernel", "program_kernel"),
        ("cuLaunchKernel", "program_kernel"),
    ]
    assert {ctx for _, _, ctx in calls} == {"1"}, calls


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support"))
    print(json.dumps(_worker(sys.argv[2], sys.argv[3])))
