"""The ``cuda_ipc`` transport: every rank's workspace buffer in device memory, shared by CUDA IPC.

Each rank allocates its buffer with ``cudaMalloc`` (through CuPy's runtime bindings, not torch's
caching allocator: an IPC handle covers a whole allocation, and the caching allocator may pack
several tensors into one), zeroes it, and publishes a JSON header (pid, PCI bus id, size), a
newline and the 64-byte ``cudaIpcMemHandle_t``. Peers open the handle with lazy peer access.
Several ranks may share one GPU; a process never opens its own handle (CUDA refuses that).

A rank that cannot take part says so through the handshake, and every rank raises
:class:`~gpucomm.errors.WorkspaceUnavailableError` at the same step: no CuPy, no device memory, a
peer's GPU it cannot see or reach, or a handle ``cudaIpcOpenMemHandle`` refuses (containers
without a shared IPC namespace).

``close()`` is collective: every rank unmaps its peers, then waits at a store barrier before
freeing its own buffer, so that no peer still maps memory that is freed. A peer whose process
has ended (judged by the pid its header published, where that pid means it: same pid namespace)
maps nothing any more, and is not waited for. Every step of the close is tried, past a refused
one (after a kernel fault the device's synchronize raises, and every call after it): the barrier
is still met and the rest still released, and the first error is raised at the end.

CuPy is imported only when this transport is used.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable
from types import ModuleType

import torch

from gpucomm.errors import CommMismatchError, GpucommError, UnsupportedError, WorkspaceUnavailableError
from gpucomm.ops.contract import alias_bytes
from gpucomm.transport.processes import alive, pid_space
from gpucomm.transport.workspace import Handshake, Workspace, buffer_layout

__all__ = ["open_cuda_ipc", "cuda_ipc_available"]

_NEEDS_CUPY = (
    "gpucomm: transport cuda_ipc needs CuPy (pip install gpucomm[cuda12] or [cuda13], matching "
    "your CUDA major version) and a CUDA device"
)
IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)
# cudaIpcMemLazyEnablePeerAccess (driver_types.h); not every CuPy exports the name.
_LAZY_ENABLE_PEER_ACCESS = 1
_MAX_HEADER_BYTES = 256
# What lets ranks of one node open each other's handles, for the error that says they cannot.
_IPC_ADVICE = (
    "Ranks of a node need one IPC namespace (one container, or docker run --ipc=host) and GPUs "
    "that reach each other; or use GPUCOMM_TRANSPORT=gloo"
)
_BUS_ID = re.compile(r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]")


def _cupy() -> ModuleType:
    try:
        import cupy
    except ImportError as exc:
        raise UnsupportedError(f"{_NEEDS_CUPY}; CuPy is not installed ({exc})") from exc
    return cupy


def cuda_ipc_available() -> tuple[bool, str]:
    """Whether the cuda_ipc transport can run in this process, and why not when it cannot."""
    try:
        cupy = _cupy()
    except UnsupportedError as exc:
        return False, str(exc)
    if not torch.cuda.is_available():
        return False, f"{_NEEDS_CUPY}; torch {torch.__version__} sees no CUDA device"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return False, f"{_NEEDS_CUPY}; the CUDA runtime reports: {exc}"
    if count == 0:
        return False, f"{_NEEDS_CUPY}; no CUDA device is visible"
    return True, ""


def _nvml_p2p_ok(bus_a: str, bus_b: str) -> bool | None:
    """NVML's view of peer reads between two GPUs; None when NVML cannot say."""
    return _nvml_p2p_status(bus_a, bus_b, "READ")


def _nvml_p2p_atomics(bus_a: str, bus_b: str) -> bool | None:
    """NVML's view of native atomics between two GPUs; None when NVML cannot say."""
    return _nvml_p2p_status(bus_a, bus_b, "ATOMICS")


def _nvml_p2p_status(bus_a: str, bus_b: str, caps: str) -> bool | None:
    try:
        import pynvml
    except ImportError:
        return None
    index = getattr(pynvml, f"NVML_P2P_CAPS_INDEX_{caps}", None)
    if not hasattr(pynvml, "nvmlDeviceGetP2PStatus") or index is None:
        return None
    try:
        pynvml.nvmlInit()
        try:
            a = pynvml.nvmlDeviceGetHandleByPciBusId(bus_a.encode())
            b = pynvml.nvmlDeviceGetHandleByPciBusId(bus_b.encode())
            status = pynvml.nvmlDeviceGetP2PStatus(a, b, index)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None
    return status == pynvml.NVML_P2P_STATUS_OK


# cudaDevP2PAttrNativeAtomicSupported (driver_types.h; CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED
# in cuda.h): whether the link carries atomics into the peer's memory natively. NVLink and NVSwitch
# do; PCIe between two GPUs does not, and there an atomic into peer memory is not guaranteed to be
# atomic. The Triton program kernel releases a flag with an atomic exchange into each peer's flag
# area at system scope (kernels/triton/program.py), and so do gpucomm.language's kernels, which any
# communicator's device_context offers whatever its kernels; the CUDA C++ kernels release with
# stores, but the workspace serves the device API too, so every cuda_ipc workspace asks.
_P2P_NATIVE_ATOMICS = 3


def _peer_atomics(runtime: object, dev: int, peer_dev: int | None, bus: str, peer_bus: str) -> bool | None:
    """Whether device ``dev``'s kernels have native atomics into the GPU at ``peer_bus``: the CUDA
    runtime's word where it has the query and sees the peer, else NVML's; None where neither can say."""
    ask = getattr(runtime, "deviceGetP2PAttribute", None)
    if ask is not None and peer_dev is not None:
        return bool(ask(_P2P_NATIVE_ATOMICS, dev, peer_dev))
    return _nvml_p2p_atomics(bus, peer_bus)


def _check_peers(cupy: ModuleType, dev: int, bus: str, peer_buses: dict[int, str]) -> None:
    """Raises UnsupportedError where a peer's GPU (``peer_buses``: rank -> PCI bus) is out of
    reach, or lacks native peer atomics with this one, naming every pair that lacks them. A pair
    neither the runtime nor NVML can say of is taken as having them, as before the check."""
    lacking = [
        f"rank {peer} ({peer_bus})"
        for peer, peer_bus in peer_buses.items()
        if _check_peer_access(cupy, dev, bus, peer, peer_bus) is False
    ]
    if lacking:
        raise UnsupportedError(
            f"gpucomm cuda_ipc: GPU {bus} (device {dev}) has no native peer atomics with the GPUs of "
            f"{', '.join(lacking)} (cudaDevP2PAttrNativeAtomicSupported=0, or NVML's atomics status: a PCIe link "
            "has none), and the kernels' flags "
            "are atomic exchanges into peer memory; use GPUCOMM_TRANSPORT=gloo"
        )


def _check_peer_access(cupy: ModuleType, dev: int, bus: str, peer: int, peer_bus: str) -> bool | None:
    """Raises UnsupportedError where this GPU cannot reach rank ``peer``'s; else whether the pair
    has native peer atomics (True on one GPU; None: nothing can say)."""
    runtime = cupy.cuda.runtime
    try:
        peer_dev = runtime.deviceGetByPCIBusId(peer_bus)
    except runtime.CUDARuntimeError as exc:
        # One GPU visible per rank (CUDA_VISIBLE_DEVICES per task): cudaIpcOpenMemHandle opens
        # handles of GPUs this process cannot see, so NVML, which knows every GPU by its bus,
        # decides whether the two reach each other.
        nvml = _nvml_p2p_ok(bus, peer_bus)
        if nvml:
            return _peer_atomics(runtime, dev, None, bus, peer_bus)
        raise UnsupportedError(
            f"gpucomm cuda_ipc: rank {peer}'s GPU {peer_bus} is not visible to this process (GPU {bus}), and NVML "
            + (
                "says the two cannot reach each other peer to peer"
                if nvml is False
                else "cannot say whether they reach each other"
            )
            + "; "
            "check CUDA_VISIBLE_DEVICES, or use GPUCOMM_TRANSPORT=gloo"
        ) from exc
    if peer_dev == dev:
        return True
    can = bool(runtime.deviceCanAccessPeer(dev, peer_dev))
    nvml = _nvml_p2p_ok(bus, peer_bus)
    if not can or nvml is False:
        raise UnsupportedError(
            f"gpucomm cuda_ipc: GPU {bus} (device {dev}) cannot access GPU {peer_bus} (device {peer_dev}, "
            f"rank {peer}) peer to peer (cudaDeviceCanAccessPeer={int(can)}, NVML P2P read ok={nvml}); "
            "use GPUCOMM_TRANSPORT=gloo"
        )
    return _peer_atomics(runtime, dev, peer_dev, bus, peer_bus)


def _parse_handle(raw: bytes, peer: int, size: int) -> tuple[dict, bytes]:
    where = f"gpucomm cuda_ipc workspace: the handle of rank {peer}"
    head, sep, handle = raw.partition(b"\n") if isinstance(raw, bytes) else (b"", b"", b"")
    if not sep or len(head) > _MAX_HEADER_BYTES or len(handle) != IPC_HANDLE_BYTES:
        raise GpucommError(
            f"{where} must be a JSON header, a newline and {IPC_HANDLE_BYTES} handle bytes; got "
            f"{len(raw) if isinstance(raw, bytes) else type(raw).__name__} bytes: {raw[:80]!r}"
        )
    try:
        header = json.loads(head.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise GpucommError(f"{where} has a header that is not ASCII JSON: {head[:80]!r}") from exc
    if (
        not isinstance(header, dict)
        or set(header) != {"pid", "pid_space", "bus_id", "size"}
        or not isinstance(header["pid"], int)
        or not isinstance(header["pid_space"], str)
        or not isinstance(header["bus_id"], str)
        or _BUS_ID.fullmatch(header["bus_id"]) is None
    ):
        raise GpucommError(f"{where} has a malformed header {head[:120]!r}")
    if isinstance(header["size"], bool) or header["size"] != size:
        raise CommMismatchError(
            f"{where} has a buffer of {header['size']!r} bytes, expected {size}: ranks passed different "
            "data_bytes or flag_count to open_workspace"
        )
    return header, handle


def _open_handle(runtime: object, handle: bytes, peer: int, rank: int) -> int:
    """``peer``'s buffer mapped into this process, or the host's reason why it cannot be."""
    try:
        return runtime.ipcOpenMemHandle(handle, _LAZY_ENABLE_PEER_ACCESS)  # type: ignore[attr-defined]
    except runtime.CUDARuntimeError as exc:  # type: ignore[attr-defined]
        raise WorkspaceUnavailableError(
            "cuda_ipc", {rank: f"cudaIpcOpenMemHandle of rank {peer}'s buffer failed: {exc}"}, _IPC_ADVICE
        ) from exc


class _Buffers:
    """This rank's cudaMalloc'd buffer and the peers' opened IPC pointers."""

    def __init__(self, cupy: ModuleType, dev: int, handshake: Handshake) -> None:
        self.cupy = cupy
        self.dev = dev
        self.handshake = handshake
        self.own: int | None = None
        self.peers: list[int] = []
        # Our handle went out: peers may map our buffer, and must unmap it before we free it (on
        # a failed open too: every rank then reaches release, and its barrier, together).
        self.opened = False
        # The peers' pids where they mean those processes here (same pid namespace).
        self.peer_pids: dict[int, int] = {}

    def _ended(self, peer: int) -> bool:
        """Whether ``peer``'s process has ended (its mappings went with it)."""
        pid = self.peer_pids.get(peer)
        return pid is not None and not alive(pid)

    def release(self) -> None:
        """Unmap the peers, meet the close barrier, free this rank's buffer (module docstring).

        Every step is tried; the first error is raised after the last.
        """
        runtime = self.cupy.cuda.runtime
        errors: list[BaseException] = []

        def attempt(step: Callable[[], object]) -> None:
            try:
                step()
            except runtime.CUDARuntimeError as exc:
                errors.append(exc)

        with self.cupy.cuda.Device(self.dev):
            # Kernels still reading peers must finish before their mappings go away. After a
            # kernel fault this raises, and so does every later call on this context: tried anyway.
            attempt(runtime.deviceSynchronize)
            peers, self.peers = self.peers, []
            for ptr in peers:
                attempt(lambda ptr=ptr: runtime.ipcCloseMemHandle(ptr))
            if self.opened and self.handshake.world_size > 1:
                self.opened = False
                try:
                    # Freeing memory a peer still maps is undefined behaviour for CUDA IPC.
                    self.handshake.closed(gone=self._ended)
                except RuntimeError as exc:  # CommTimeoutError, or the store is already gone
                    warnings.warn(
                        f"gpucomm cuda_ipc: rank {self.handshake.rank} could not confirm that every peer "
                        f"unmapped its workspace ({exc}); freeing it anyway",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            own, self.own = self.own, None
            if own is not None:
                attempt(lambda: runtime.free(own))
        if errors:
            raise errors[0]


def open_cuda_ipc(handshake: Handshake, *, data_bytes: int, flag_count: int, device: torch.device) -> Workspace:
    """Allocate, publish and open the cuda_ipc workspace (module docstring).

    Raises ValueError for a device that is not CUDA; otherwise as
    :func:`gpucomm.transport.open_workspace`.
    """
    if device.type != "cuda":
        raise ValueError(f"open_workspace: the cuda_ipc transport needs a cuda device, got {device}")
    rank, world_size = handshake.rank, handshake.world_size
    ok, reason = cuda_ipc_available()
    if not ok:
        handshake.fail(WorkspaceUnavailableError("cuda_ipc", {rank: reason}))  # every peer raises it too, now
    cupy = _cupy()
    runtime = cupy.cuda.runtime
    dev = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", dev)
    _, size = buffer_layout(data_bytes, flag_count)
    buffers = _Buffers(cupy, dev, handshake)
    bases: list[int] = [0] * world_size
    try:
        try:
            with cupy.cuda.Device(dev):
                bus = runtime.deviceGetPCIBusId(dev)
                buffers.own = bases[rank] = runtime.malloc(size)
                runtime.memset(bases[rank], 0, size)  # every flag starts at 0
                runtime.deviceSynchronize()  # zeroed before any peer can see the handle
                handle = bytes(runtime.ipcGetMemHandle(bases[rank]))
        except runtime.CUDARuntimeError as exc:
            reason = f"cannot make its {size}-byte buffer on device {dev}: {exc}"
            handshake.fail(WorkspaceUnavailableError("cuda_ipc", {rank: reason}))
        header = json.dumps({"pid": os.getpid(), "pid_space": pid_space(), "bus_id": bus, "size": size}).encode("ascii")
        raws = handshake.exchange(header + b"\n" + handle)
        buffers.opened = True
        try:
            parsed = {peer: _parse_handle(raw, peer, size) for peer, raw in enumerate(raws) if peer != rank}
            here = pid_space()
            buffers.peer_pids = {peer: h["pid"] for peer, (h, _) in parsed.items() if h["pid_space"] == here}
            with cupy.cuda.Device(dev):
                _check_peers(cupy, dev, bus, {peer: h["bus_id"] for peer, (h, _) in parsed.items()})
                for peer, (_, peer_handle) in parsed.items():
                    bases[peer] = _open_handle(runtime, peer_handle, peer, rank)
                    buffers.peers.append(bases[peer])
            views = [alias_bytes(base, size, device) for base in bases]  # each checked to alias, not copy
        except WorkspaceUnavailableError as exc:  # this host's doing: every rank falls back together
            handshake.fail(exc)
        except UnsupportedError as exc:  # a peer's GPU this one cannot see or reach, or no peer atomics
            handshake.fail(WorkspaceUnavailableError("cuda_ipc", {rank: str(exc)}))
        except GpucommError as exc:
            handshake.fail(exc)
        handshake.opened()
    except BaseException:
        views = []
        buffers.release()
        raise
    return Workspace("cuda_ipc", rank, world_size, device, data_bytes, flag_count, bases, views, buffers.release)
