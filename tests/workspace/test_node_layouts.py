"""Eight ranks on a node of eight H100s, in the three ways jobs lay ranks out, on the driver double.

The double (tests/support/cuda_double, devices.c) is the node: 8 GPUs of 132 SMs and sm_90, each
with its UUID, and the devices each process sees by its ``CUDA_VISIBLE_DEVICES``. Each rank is a
process of its own that, as gpucomm does on a GPU:

- picks its device (``_rank_device``: LOCAL_RANK modulo the visible devices);
- counts its channels with the engine's call (``node_channels``: the GPU's SMs over the ranks on
  that physical GPU, by UUID through the communicator's store);
- launches the CUDA C++ kernels through gpucomm's launcher on the double, whose modules load in
  its device's primary context: a whole communicator's all_reduce and all_gather over the
  shared-memory workspace, run by the double on host images of the kernels (moving data).

The layouts: one process per GPU with all 8 visible; one process per GPU seeing only its own
(``CUDA_VISIBLE_DEVICES=i``, as SLURM and Kubernetes set it); 8 ranks on 2 GPUs. One rank per GPU
gets 32 channels either way (132 SMs / 4 per channel, at most 32); 4 ranks on a GPU get 8.

torch here has no CUDA, so torch.cuda's device count, properties and ``device`` guard are played
on the double (what the CUDA runtime answers from the driver), only for device selection and the
channel count; the communicator itself is a CPU one (its CUDA engine would need torch's CUDA).
"""

from __future__ import annotations

import ctypes
import os

import cuda_double
import pytest
from spawn import run_ranks

from gpucomm.toolchain import native

pytestmark = pytest.mark.skipif(
    native.load("launch") is None, reason="gpucomm's launcher cannot be built here (no C compiler)"
)

WORLD = 8
N = 1027  # a small all_reduce (the small kernel) and an all_gather (the program kernel)


class DoubleRuntime:
    """torch.cuda's answers as the CUDA runtime gives them from the driver double."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def device_count(self) -> int:
        count = ctypes.c_int()
        assert self.lib.cuDeviceGetCount(ctypes.byref(count)) == 0
        return count.value

    def get_device_properties(self, device: object):  # noqa: ANN201
        import types
        import uuid

        import torch

        index = torch.device(device).index if not isinstance(device, int) else device
        attribute = ctypes.c_int()
        values = {}
        for name, number in (("multi_processor_count", 16), ("major", 75), ("minor", 76)):
            assert self.lib.cuDeviceGetAttribute(ctypes.byref(attribute), number, index) == 0
            values[name] = attribute.value
        raw = ctypes.create_string_buffer(16)
        assert self.lib.cuDeviceGetUuid_v2(raw, index) == 0
        return types.SimpleNamespace(uuid=uuid.UUID(bytes=raw.raw[:16]), **values)

    def current_device(self) -> int:
        """The device of the thread's current context (-1: none)."""
        context, device = ctypes.c_void_p(), ctypes.c_int(-1)
        assert self.lib.cuCtxGetCurrent(ctypes.byref(context)) == 0
        if context.value:
            assert self.lib.cuCtxGetDevice(ctypes.byref(device)) == 0
        return device.value

    def device(self, device: object):  # noqa: ANN201
        """``torch.cuda.device(d)``: d's primary context current inside, the thread's own after."""
        import contextlib

        import torch

        index = torch.device(device).index if not isinstance(device, int) else device

        @contextlib.contextmanager
        def guard():  # noqa: ANN202
            before, context = ctypes.c_void_p(), ctypes.c_void_p()
            assert self.lib.cuCtxGetCurrent(ctypes.byref(before)) == 0
            assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), index) == 0
            assert self.lib.cuCtxSetCurrent(context) == 0
            try:
                yield
            finally:
                assert self.lib.cuCtxSetCurrent(before) == 0

        return guard()


def _rank(rank: int, world_size: int, double: str, visible: list[str] | None, folder: str) -> dict:
    # The double reads the node and the log's name when it loads, as each rank process of a job
    # starts with its own CUDA_VISIBLE_DEVICES.
    if visible is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[rank]
    os.environ[cuda_double.LOG_VARIABLE] = os.path.join(folder, f"rank{rank}.log")
    lib = ctypes.CDLL(double)
    assert lib.cuInit(0) == 0

    import torch
    from cuda_kernels_double import cuda_kernels_running_on_the_double

    import gpucomm
    from gpucomm.comm.communicator import _rank_device
    from gpucomm.ops import registry
    from gpucomm.workspace.gpu_share import node_channels

    runtime = DoubleRuntime(lib)
    saved = {name: getattr(torch.cuda, name) for name in ("is_available", "device_count", "get_device_properties")}
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = runtime.device_count
    torch.cuda.get_device_properties = runtime.get_device_properties
    device = _rank_device(int(os.environ["LOCAL_RANK"]))
    torch.cuda.is_available = saved["is_available"]  # the communicator below is a CPU one
    with runtime.device(device):
        context = runtime.current_device()

    kernels = cuda_kernels_running_on_the_double(double)
    kernels._index = device.index  # its modules load in this rank's device's primary context
    registry.install("cuda", "cpu", kernels)
    gpucomm.init_process_group(transport="shm", kernels="cuda", timeout=120)
    comm = gpucomm.get_default_communicator()
    channels = node_channels(0, "cuda", device, comm.store, "node-layouts/gpu/", rank, world_size, 120.0)
    t = torch.full((N,), float(rank + 1))
    gpucomm.all_reduce(t)
    out = torch.full((world_size * N,), float("nan"))
    gpucomm.all_gather_into_tensor(out, torch.full((N,), float(rank)))
    right = torch.equal(t, torch.full((N,), float(sum(range(1, world_size + 1)))))
    gathered = torch.equal(out, torch.arange(world_size).float().repeat_interleave(N))
    gpucomm.destroy_process_group()
    for name, value in saved.items():
        setattr(torch.cuda, name, value)
    return {"device": str(device), "context": context, "channels": channels, "right": right, "gathered": gathered}


LAYOUTS = {
    # name: (CUDA_VISIBLE_DEVICES per rank or None for unset, each rank's device, its physical GPU, channels)
    "all_visible": (None, [f"cuda:{r}" for r in range(WORLD)], list(range(WORLD)), 32),
    "own_gpu_only": ([str(r) for r in range(WORLD)], ["cuda:0"] * WORLD, list(range(WORLD)), 32),
    "four_ranks_per_gpu": (["0,1"] * WORLD, [f"cuda:{r % 2}" for r in range(WORLD)], [r % 2 for r in range(WORLD)], 8),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_eight_ranks_pick_their_gpu_count_their_channels_and_launch_in_their_own_context(layout, tmp_path) -> None:
    visible, devices, gpus, channels = LAYOUTS[layout]
    double = cuda_double.build()
    logs = [str(tmp_path / f"rank{r}.log") for r in range(WORLD)]
    results = run_ranks(_rank, WORLD, double, visible, str(tmp_path), timeout=600)
    for rank, result in enumerate(results):
        index = int(devices[rank].split(":")[1])
        assert result == {
            "device": devices[rank],
            "context": index,
            "channels": channels,
            "right": True,
            "gathered": True,
        }, (rank, result)
        records = cuda_double.records(logs[rank])
        retained = {(r["device"], r["gpu"]) for r in records if r.entry == "cuDevicePrimaryCtxRetain"}
        assert retained == {(str(index), str(gpus[rank]))}, (rank, retained)  # only its own GPU's context
        launched = [r["ctx"] for r in records if r.entry == "cuLaunchKernel"]
        assert len(launched) >= 2 and set(launched) == {str(index)}, (rank, launched)
        assert not [r for r in records if r.get("refused") == "1"], rank
