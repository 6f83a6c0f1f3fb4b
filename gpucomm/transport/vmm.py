"""The GPU's symmetric heap from the driver's virtual-memory API (:func:`open_vmm_heap`).

Uses NVIDIA's ``cuda.bindings`` (``pip install gpucomm[vmm]``; CuPy binds none of these calls),
imported only here and in :mod:`gpucomm.transport.multicast`, only when a GPU communicator opens
its heap. Where VMM is missing (no cuda.bindings, a driver or GPU without it), the heap is a CUDA
IPC allocation of its own (``cudaIpcGetMemHandle``) instead, and the engine says so when the heap
opens.

On every local rank:

1. ``cuMemCreate`` of ``nbytes`` (rounded to the allocation granularity), shareable as a POSIX
   file descriptor; ``cuMemAddressReserve`` of P times that, one range for every rank's heap;
   ``cuMemMap`` + ``cuMemSetAccess`` of this rank's part, zeroed (the multimem signal pad must
   start at 0);
2. ``cuMemExportToShareableHandle`` to a descriptor, passed to every peer over the node's Unix
   sockets (:mod:`gpucomm.transport.fdpass`, SCM_RIGHTS);
3. every peer's descriptor imported and mapped at its place: rank p's heap at ``base + p * size``.

Each step ends in a store agreement that carries every rank's verdict, so a driver refusal on one
rank is raised on every rank instead of the others waiting out the timeout.

Release, per rank, in reverse order: every mapping, the range, every handle. A VMM allocation
lives until its last handle and mapping are gone, so no rank waits for another to release its own.
The node's multicast object over these heaps is :mod:`gpucomm.transport.multicast`'s.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType

from gpucomm.errors import GpucommError, UnsupportedError
from gpucomm.transport.fdpass import FdExchange

__all__ = [
    "first_reason",
    "vmm_unavailable",
    "gpu_identity",
    "open_vmm_heap",
    "VmmHeap",
    "VmmHeapRefused",
]

_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_ATTR_VMM = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ATTR_POSIX_FD = 103  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
_TAG_HEAP = 1  # the fd exchange's tag for heap descriptors (gpucomm.transport.multicast's is 2)


def _driver() -> ModuleType:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise UnsupportedError(f"cuda.bindings is not installed (pip install gpucomm[vmm]): {exc}") from exc
    return driver


def _check(result: tuple, call: str) -> object:
    """The value of a cuda.bindings call, or GpucommError with the driver's name for its error."""
    err, *values = result
    if int(err) != 0:
        driver = _driver()
        _, name = driver.cuGetErrorName(err)
        text = name.decode() if isinstance(name, bytes) else str(err)
        raise GpucommError(f"gpucomm symmetric heap: {call} failed: {text}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def first_reason(reasons: list[str]) -> str:
    """ "rank r: reason" of the first rank that gave one in ``reasons`` (in rank order), else ""."""
    return next((f"rank {r}: {reason}" for r, reason in enumerate(reasons) if reason), "")


def _attribute(driver: ModuleType, attribute: int, device: int) -> int:
    return int(
        _check(driver.cuDeviceGetAttribute(driver.CUdevice_attribute(attribute), device), "cuDeviceGetAttribute")
    )


@contextlib.contextmanager
def _on_device(driver: ModuleType, device: int) -> Iterator[None]:
    """Make ``device``'s primary context (torch's) current inside, and the thread's own after.

    The thread may hold another GPU's context (a process driving several GPUs; a release run by
    whichever thread drops the last tensor), where these calls would act on the wrong GPU. The
    primary context stays retained: the heap's memory lives in it.
    """
    _check(driver.cuInit(0), "cuInit")
    ctx = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is not None and int(ctx) != 0 and int(_check(driver.cuCtxGetDevice(), "cuCtxGetDevice")) == device:
        yield
        return
    _check(
        driver.cuCtxPushCurrent(_check(driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")),
        "cuCtxPushCurrent",
    )
    try:
        yield
    finally:
        _check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")


def vmm_unavailable(device: int) -> str:
    """Why the heap cannot come from the virtual-memory API on ``device`` ("" if it can)."""
    try:
        driver = _driver()
        _check(driver.cuInit(0), "cuInit")  # a query: no context needed
        if not _attribute(driver, _ATTR_VMM, device):
            return f"GPU {device} does not support virtual memory management"
        if not _attribute(driver, _ATTR_POSIX_FD, device):
            return f"GPU {device} cannot share memory as POSIX file descriptors"
    except (UnsupportedError, GpucommError) as exc:
        return str(exc)
    return ""


def gpu_identity(device: int) -> str:
    """``device``'s UUID in hex, the same in every process whatever its ordinal; "" if unknown."""
    try:
        driver = _driver()
        _check(driver.cuInit(0), "cuInit")  # a query: no context needed
        return bytes(_check(driver.cuDeviceGetUuid(device), "cuDeviceGetUuid").bytes).hex()
    except (UnsupportedError, GpucommError):
        return ""


@dataclass
class VmmHeap:
    """Every rank's heap mapped in this process: rank p's at ``bases[p]``, ``size`` bytes each."""

    bases: list[int]
    size: int
    device: int
    own_handle: object  # this rank's CUmemGenericAllocationHandle (what a multicast object binds)
    _reserved: int = 0
    _handles: list = field(default_factory=list)
    _mapped: list = field(default_factory=list)

    def release(self) -> None:
        """Unmap every part, free the range, release every handle (once).

        Waits for the device first, since a kernel may still read a peer's heap. Every step is tried;
        the first failure is raised after the last.
        """
        driver = _driver()
        with _on_device(driver, self.device):
            self._release(driver)

    def _release(self, driver: ModuleType) -> None:
        steps = _ReleaseSteps()
        if self._mapped:
            steps(driver.cuCtxSynchronize(), "cuCtxSynchronize")
        mapped, self._mapped = self._mapped, []
        for addr in mapped:
            steps(driver.cuMemUnmap(addr, self.size), "cuMemUnmap")
        if self._reserved:
            reserved, self._reserved = self._reserved, 0
            steps(driver.cuMemAddressFree(reserved, self.size * len(self.bases)), "cuMemAddressFree")
        handles, self._handles = self._handles, []
        for handle in handles:
            steps(driver.cuMemRelease(handle), "cuMemRelease")
        steps.done()


class _ReleaseSteps:
    """Release calls that go on past a failure; :meth:`done` raises the first one.

    A release skipped would leak GiBs of heap.
    """

    def __init__(self) -> None:
        self.first: GpucommError | None = None

    def __call__(self, result: tuple, call: str) -> None:
        try:
            _check(result, call)
        except GpucommError as exc:
            self.first = self.first or exc

    def done(self) -> None:
        if self.first is not None:
            raise self.first


def _access(driver: ModuleType, device: int) -> object:
    desc = driver.CUmemAccessDesc()
    desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


class VmmHeapRefused(GpucommError):
    """The driver refused a rank's part of the heap (no memory, an import it cannot take).

    Every rank raises it at the same step, with that rank's reason; the engine takes another heap.
    """


def open_vmm_heap(
    exchange: FdExchange,
    rank: int,
    world_size: int,
    device: int,
    nbytes: int,
    align: int = 1,
    agreed: Callable[[str, str], list[str]] | None = None,
) -> VmmHeap:
    """Create, share and map every rank's heap (module docstring); collective over the node.

    Its size is ``nbytes`` rounded up to the allocation granularity and to ``align`` (a power of
    two: the multicast granularity where a multicast object will bind the heap).

    Raises :class:`VmmHeapRefused` on every rank when the driver refuses any rank's step:
    ``agreed(stage, mine)`` returns every local rank's ``mine`` at ``stage`` ("" for done), so the
    peers do not wait out the timeout for a descriptor that never comes. Without ``agreed``, a
    refusal raises on its own rank only.
    """
    driver = _driver()
    with _on_device(driver, device):
        return _open_vmm_heap(driver, exchange, rank, world_size, device, nbytes, align, agreed)


def _open_vmm_heap(
    driver: ModuleType,
    exchange: FdExchange,
    rank: int,
    world_size: int,
    device: int,
    nbytes: int,
    align: int,
    agreed: Callable[[str, str], list[str]] | None,
) -> VmmHeap:
    def settle(stage: str, failure: str) -> None:
        if agreed is None:
            if failure:
                raise VmmHeapRefused(failure)
            return
        why = first_reason(agreed(stage, failure))
        if why:
            raise VmmHeapRefused(why)

    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = driver.CUmemAllocationHandleType(_POSIX_FD)
    recommended = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    granularity = int(_check(driver.cuMemGetAllocationGranularity(prop, recommended), "cuMemGetAllocationGranularity"))
    unit = max(granularity, align)  # both powers of two: the larger is a multiple of the other
    size = -(-nbytes // unit) * unit
    heap = VmmHeap(bases=[0] * world_size, size=size, device=device, own_handle=None)
    fd = -1
    try:
        failure = ""
        try:
            handle = _check(driver.cuMemCreate(size, prop, 0), "cuMemCreate")
            heap._handles.append(handle)
            heap.own_handle = handle
            base = int(_check(driver.cuMemAddressReserve(size * world_size, granularity, 0, 0), "cuMemAddressReserve"))
            heap._reserved = base
            heap.bases = [base + p * size for p in range(world_size)]
            _map(driver, heap, rank, handle, device)
            _check(driver.cuMemsetD8(heap.bases[rank], 0, size), "cuMemsetD8")
            _check(driver.cuCtxSynchronize(), "cuCtxSynchronize")  # zeroed before any peer maps it
            fd = int(
                _check(
                    driver.cuMemExportToShareableHandle(handle, driver.CUmemAllocationHandleType(_POSIX_FD), 0),
                    "cuMemExportToShareableHandle",
                )
            )
        except GpucommError as exc:
            failure = str(exc)
        settle("heap_made", failure)  # every rank has a heap to share before any waits for one
        try:
            peers = exchange.share(fd, _TAG_HEAP)
        finally:
            os.close(fd)
            fd = -1
        try:
            for peer in sorted(peers):
                imported = _check(
                    driver.cuMemImportFromShareableHandle(peers[peer], driver.CUmemAllocationHandleType(_POSIX_FD)),
                    "cuMemImportFromShareableHandle",
                )
                heap._handles.append(imported)
                _map(driver, heap, peer, imported, device)
        except GpucommError as exc:
            failure = str(exc)
        finally:
            for received in peers.values():
                os.close(received)
        settle("heap_mapped", failure)  # every rank maps every heap: none is used before
    except BaseException:
        if fd >= 0:
            os.close(fd)
        heap.release()
        raise
    return heap


def _map(driver: ModuleType, heap: VmmHeap, peer: int, handle: object, device: int) -> None:
    addr = heap.bases[peer]
    _check(driver.cuMemMap(addr, heap.size, 0, handle, 0), "cuMemMap")
    heap._mapped.append(addr)
    _check(driver.cuMemSetAccess(addr, heap.size, [_access(driver, device)], 1), "cuMemSetAccess")
