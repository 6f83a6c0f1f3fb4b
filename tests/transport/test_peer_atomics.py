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


class DoubleCupy:
    """``cupy`` for what opening the cuda_ipc workspace asks of it: the runtime above plus the
    allocation calls (made-up addresses: the open is refused before any peer memory is mapped)."""

    def __init__(self, lib: ctypes.CDLL, rank: int) -> None:
        import contextlib

        runtime = DoubleRuntime(lib)
        runtime.malloc = lambda size: 0x7000_0000_0000 + (rank << 32)
        runtime.memset = lambda ptr, value, size: None
        runtime.deviceSynchronize = lambda: None
        runtime.ipcGetMemHandle = lambda ptr: bytes([rank + 1]) * 64
        runtime.ipcCloseMemHandle = runtime.free = lambda ptr: None
        device = lambda dev: contextlib.nullcontext()  # noqa: E731
        self.cuda = types.SimpleNamespace(runtime=runtime, Device=device)


def _open_on_the_double(rank: int, world_size: int, double: str) -> str:
    """Rank r opens the cuda_ipc workspace on GPU r of the double's node: "" or what it raised."""
    import os

    import torch

    from gpucomm.errors import WorkspaceUnavailableError
    from gpucomm.transport import cuda_ipc, open_workspace

    lib = ctypes.CDLL(double)
    assert lib.cuInit(0) == 0
    fake = DoubleCupy(lib, rank)
    cuda_ipc._cupy = lambda: fake
    cuda_ipc.cuda_ipc_available = lambda: (True, "")  # torch here has no CUDA
    cuda_ipc._nvml_p2p_ok = cuda_ipc._nvml_p2p_atomics = lambda a, b: None  # no NVML on this host
    store = torch.distributed.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, rank == 0, wait_for_workers=False
    )
    try:
        open_workspace(
            "cuda_ipc",
            store=store,
            prefix="peer-atomics/",
            rank=rank,
            world_size=world_size,
            data_bytes=1 << 20,
            flag_count=64,
            device=torch.device("cuda", rank),
            timeout=60,
        )
    except WorkspaceUnavailableError as err:
        said = str(err)
    else:
        said = ""
    # Rank 0 serves the store: it leaves only once every rank is done with it.
    store.set(f"peer-atomics/done/{rank}", b"1")
    store.wait([f"peer-atomics/done/{r}" for r in range(world_size)])
    return said


def test_a_pcie_box_refuses_the_cuda_ipc_workspace_on_every_rank_naming_the_pair() -> None:
    """Both ranks raise WorkspaceUnavailableError (the communicator's cue to serve its CUDA tensors
    with gloo, with one warning line), each naming both ranks' view of the pair."""
    double = cuda_double.build()
    messages = run_ranks(_open_on_the_double, 2, double, timeout=120, env={"DRIVER_DOUBLE_LINKS": "pcie"})
    for message in messages:
        assert "cuda_ipc workspace unavailable" in message, message
        for rank, gpu, peer, peer_gpu in ((0, "18", 1, "28"), (1, "28", 0, "18")):
            said = f"rank {rank}: gpucomm cuda_ipc: GPU 0000:{gpu}:00.0 (device {rank}) has no native peer atomics"
            assert f"{said} with the GPUs of rank {peer} (0000:{peer_gpu}:00.0)" in message, message


@pytest.mark.parametrize(("atomics", "refused"), [(True, False), (None, False), (False, True)])
def test_a_peer_this_process_cannot_see_is_judged_by_nvmls_atomics_status(monkeypatch, atomics, refused) -> None:
    """One GPU visible per rank: the runtime cannot name the peer's device, so NVML's status of the
    pair (by bus) says whether it has native atomics; where NVML cannot say, the pair passes as it
    did before the check."""
    from gpucomm.errors import UnsupportedError
    from gpucomm.transport import cuda_ipc

    class _Runtime:
        class CUDARuntimeError(RuntimeError):
            pass

        def deviceGetByPCIBusId(self, bus: str) -> int:  # noqa: N802 - CuPy's name
            raise self.CUDARuntimeError("cudaErrorInvalidDevice")

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=_Runtime()))
    monkeypatch.setattr(cuda_ipc, "_nvml_p2p_ok", lambda a, b: True)
    monkeypatch.setattr(cuda_ipc, "_nvml_p2p_atomics", lambda a, b: atomics)
    peers = {1: "0000:28:00.0", 2: "0000:38:00.0"}
    if not refused:
        cuda_ipc._check_peers(cupy, 0, "0000:18:00.0", peers)
        return
    with pytest.raises(UnsupportedError, match=r"with the GPUs of rank 1 \(0000:28:00.0\), rank 2 \(0000:38:00.0\)"):
        cuda_ipc._check_peers(cupy, 0, "0000:18:00.0", peers)
