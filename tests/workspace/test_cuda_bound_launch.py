"""The CUDA C++ kernels through gpucomm's real launch path, with data: the first call of a shape binds
its launch (the program kernel's ``ProgramArgs``, the small all_reduce's ``SmallArgs``, packed once
by ``kernels/host/launch.c``), every repeated call is one ``cuLaunchKernel`` of that binding, and a
CUDA graph replays it, as on a GPU.

Two ranks on CPU tensors over the shared-memory workspace. The driver is the tests' double, and
the kernels' images are host images of ``kernels/cuda/program.cu`` and ``small.cu`` built for the
host (gpucomm.ops.cuda_host), so each launch the double receives runs the kernel on the packed
parameters (tests/support/cuda_double/host_run.c), every block with the GPU's 512 threads: the
results are checked against the float64 reference, outputs poisoned first, on reused buffers.
"""

from __future__ import annotations

import cuda_double
import pytest
from spawn import run_ranks

from gpucomm.toolchain import native

pytestmark = pytest.mark.skipif(
    native.load("launch") is None, reason="gpucomm's launcher cannot be built here (no C compiler)"
)

REPEATS = 6
N = 4099  # not a multiple of 16 bytes: the kernels' scalar tails run too


def _expected(world: int, k: int, n: int):  # noqa: ANN202
    import torch

    inputs = [_input(r, k, n) for r in range(world)]
    return torch.stack([x.double() for x in inputs]).sum(0).float()


def _input(rank: int, k: int, n: int):  # noqa: ANN202
    import torch

    g = torch.Generator().manual_seed(1000 * k + rank)
    return torch.randint(-1000, 1000, (n,), generator=g).float()  # integers: every fold order is exact


def _install(double: str) -> None:
    from cuda_kernels_double import cuda_kernels_running_on_the_double

    from gpucomm.ops import registry

    registry.install("cuda", "cpu", cuda_kernels_running_on_the_double(double))


def _repeated(rank: int, world_size: int, double: str, algo: str) -> dict:
    import torch

    import gpucomm

    _install(double)
    gpucomm.init_process_group(transport="shm", kernels="cuda", algo=algo, timeout=60)
    t = torch.empty(N)
    right, launched = [], []
    for k in range(REPEATS):
        t.copy_(_input(rank, k, N))  # the same buffer: from the second call on, the repeat fast path
        before = cuda_double.launches(double)
        gpucomm.all_reduce(t)
        launched.append(cuda_double.launches(double) - before)
        right.append(torch.equal(t, _expected(world_size, k, N)))
    out = torch.full((world_size * N,), float("nan"))  # poisoned
    gpucomm.all_gather_into_tensor(out, _input(rank, 0, N))
    gathered = torch.equal(out, torch.cat([_input(r, 0, N) for r in range(world_size)]))
    gpucomm.destroy_process_group()
    return {"right": right, "launched": launched, "gathered": gathered}


@pytest.mark.parametrize("algo", ["auto", "oneshot_small"])
def test_every_call_is_one_launch_of_its_binding_and_moves_the_right_data(algo: str) -> None:
    double = cuda_double.build()
    for result in run_ranks(_repeated, 2, double, algo, timeout=600):
        assert result["right"] == [True] * REPEATS
        assert result["launched"] == [1] * REPEATS  # one cuLaunchKernel per call, the first included
        assert result["gathered"]


class _CallerStream:
    """The caller's stream order as the executor sees it on a GPU: nothing to wait for, except that
    it returns False while the caller's stream captures a graph."""

    def __init__(self) -> None:
        self.capturing = False

    def to_caller(self) -> bool:
        return not self.capturing


def _replayed(rank: int, world_size: int, double: str) -> dict:
    import contextlib
    import ctypes

    import torch

    import gpucomm
    import gpucomm.workspace.device_executor as device_executor

    _install(double)
    gpucomm.init_process_group(transport="shm", kernels="cuda", timeout=60)
    # The executor's GPU branch on the CPU device: launches name the caller's stream, the stream
    # order says whether it captures, and the device guard has nothing to switch.
    order, stream = _CallerStream(), [0xE1]
    engine = gpucomm.get_default_communicator()._engines["cpu"]
    executor = engine.executor
    executor._on_gpu, executor._stream, engine.order = True, lambda: stream[0], order
    device_executor.capturing = lambda device: order.capturing
    torch.cuda.device = lambda device: contextlib.nullcontext()
    torch._C._cuda_getDevice = lambda: executor.device.index
    t = torch.empty(N)
    for k in range(3):  # bound, then learned by the fast path
        t.copy_(_input(rank, k, N))
        gpucomm.all_reduce(t)
    eager = torch.equal(t, _expected(world_size, 2, N))
    lib = ctypes.CDLL(double)
    graph, exec_ = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cuStreamBeginCapture_v2(ctypes.c_void_p(0xC0), 0) == 0
    order.capturing, stream[0] = True, 0xC0
    t.copy_(_input(rank, 5, N))
    for _ in range(2):
        gpucomm.all_reduce(t)  # captured: recorded, not run
    order.capturing, stream[0] = False, 0xE1
    assert lib.cuStreamEndCapture(ctypes.c_void_p(0xC0), ctypes.byref(graph)) == 0
    untouched = torch.equal(t, _input(rank, 5, N))
    assert lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0) == 0
    replays = []
    for k in (6, 7):
        t.copy_(_input(rank, k, N))
        assert lib.cuGraphLaunch(exec_, ctypes.c_void_p(0xF2)) == 0  # two all_reduces in place
        replays.append(torch.equal(t, world_size * _expected(world_size, k, N)))
    lib.cuGraphDestroy(graph)
    gpucomm.destroy_process_group()
    return {"eager": eager, "untouched": untouched, "replays": replays}


def test_a_captured_graph_replays_the_bound_launch_on_new_data() -> None:
    double = cuda_double.build()
    for result in run_ranks(_replayed, 2, double, timeout=600):
        assert result == {"eager": True, "untouched": True, "replays": [True, True]}
