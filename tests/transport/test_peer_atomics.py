"""The cuda_ipc peer check asks for native peer atomics (the kernels' flags are atomic exchanges into
peer memory) and names every pair that lacks them, on the driver double's node
(tests/support/cuda_double/devices.c): an HGX node (NVSwitch: every pair has them), a PCIe box
(peer access, no native atomics) and GPUs that cannot reach each other.

The check goes through CuPy's runtime, which is not installed here: in its place
:class:`DoubleRuntime` answers CuPy's calls from the double (each of them is the CUDA runtime's
call over the driver's of the same meaning; the P2P attributes share their numbers). NVML is
absent too, so it cannot say (None), as on a host without it. Each layout runs in a process of its
own, since the double reads its node when it loads.
"""

from __future__ import annotations

import ctypes
import types

import cuda_double
import pytest
from spawn import run_ranks

GPUS = 8


class DoubleRuntime:
    """``cupy.cuda.runtime`` for the calls the peer check makes, answered by the double."""

    class CUDARuntimeError(RuntimeError):
        pass

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def _ok(self, result: int, what: str) -> None:
        if result != 0:
            raise self.CUDARuntimeError(f"{what}: CUresult {result}")

    def deviceGetPCIBusId(self, dev: int) -> str:  # noqa: N802 - CuPy's name
        bus = ctypes.create_string_buffer(32)
        self._ok(self.lib.cuDeviceGetPCIBusId(bus, 32, dev), "cuDeviceGetPCIBusId")
        return bus.value.decode()

    def deviceGetByPCIBusId(self, bus: str) -> int:  # noqa: N802
        count = ctypes.c_int()
        self._ok(self.lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
        for dev in range(count.value):
            if self.deviceGetPCIBusId(dev) == bus:
                return dev
        raise self.CUDARuntimeError("cudaErrorInvalidDevice")

    def deviceCanAccessPeer(self, dev: int, peer: int) -> int:  # noqa: N802
        can = ctypes.c_int()
        self._ok(self.lib.cuDeviceCanAccessPeer(ctypes.byref(can), dev, peer), "cuDeviceCanAccessPeer")
        return can.value

    def deviceGetP2PAttribute(self, attr: int, src: int, dst: int) -> int:  # noqa: N802
        value = ctypes.c_int()
        self._ok(self.lib.cuDeviceGetP2PAttribute(ctypes.byref(value), attr, src, dst), "cuDeviceGetP2PAttribute")
        return value.value


def _check_from_gpu0(rank: int, world_size: int, double: str) -> str:
    """What rank 0 on GPU 0 of the double's node hears of its 7 peers, on GPUs 1 to 7: "" or the error."""
    from gpucomm.errors import UnsupportedError
    from gpucomm.transport import cuda_ipc

    lib = ctypes.CDLL(double)
    assert lib.cuInit(0) == 0
    runtime = DoubleRuntime(lib)
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    cuda_ipc._nvml_p2p_ok = cuda_ipc._nvml_p2p_atomics = lambda a, b: None  # no NVML on this host
    buses = {peer: runtime.deviceGetPCIBusId(peer) for peer in range(1, GPUS)}
    try:
        cuda_ipc._check_peers(cupy, 0, runtime.deviceGetPCIBusId(0), buses)
    except UnsupportedError as err:
        return str(err)
    return ""


@pytest.mark.parametrize(
    ("links", "expected"),
    [
        ("nvswitch", None),
        ("pcie", "has no native peer atomics with the GPUs of rank 1 (0000:28:00.0), rank 2 (0000:38:00.0)"),
        ("none", "cannot access GPU 0000:28:00.0 (device 1, rank 1) peer to peer"),
    ],
)
def test_the_peer_check_names_every_pair_without_native_peer_atomics(links: str, expected: str | None) -> None:
    double = cuda_double.build()
    (message,) = run_ranks(_check_from_gpu0, 1, double, timeout=120, env={"DRIVER_DOUBLE_LINKS": links})
    if expected is None:
        assert message == ""
        return
    assert expected in message, message
    if links == "pcie":
        assert "rank 7 (0000:88:00.0)" in message and "GPUCOMM_TRANSPORT=gloo" in message, message
