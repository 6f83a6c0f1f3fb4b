"""The GPU's symmetric heap from the driver's virtual-memory API, and its multicast object.

Through NVIDIA's ``cuda.bindings`` (``pip install gpucomm[vmm]``; CuPy binds none of these calls),
imported only here, only when a GPU communicator opens its heap.

The heap (:func:`open_vmm_heap`), on every local rank:

1. ``cuMemCreate`` of ``nbytes`` (rounded to the allocation granularity) on this rank's GPU,
   shareable as a POSIX file descriptor; ``cuMemAddressReserve`` of P times that, one range for
   every rank's heap; ``cuMemMap`` + ``cuMemSetAccess`` of this rank's own part, zeroed
   (``cuMemsetD8``: the multimem signal pad must start at 0);
2. ``cuMemExportToShareableHandle`` to a descriptor, passed to every peer over the node's Unix
   sockets (:mod:`gpucomm.transport.fdpass`, SCM_RIGHTS);
3. every peer's descriptor ``cuMemImportFromShareableHandle``-ed and mapped at its place in the
   range: rank p's heap at ``base + p * size`` in every process.

The multicast object (:func:`bind_multicast`, NVLink SHARP), where every GPU of the node reports
``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED`` and no two ranks share a GPU (told apart by UUID, the
same in every process whatever the GPU's ordinal there: with one visible GPU per rank every rank's
is 0). The heap's size is then a multiple of the multicast granularity too
(``CU_MULTICAST_GRANULARITY_MINIMUM``, what ``cuMulticastCreate`` and ``cuMulticastBindMem``
require), agreed before any heap is made:

1. rank 0 ``cuMulticastCreate``-s it for P devices; every rank says whether it could; rank 0
   sends its descriptor to every peer, which imports it;
2. every rank ``cuMulticastAddDevice``-s its GPU; a store agreement: every device is added before
   any rank binds memory (the driver requires every device before the first bind);
3. every rank ``cuMulticastBindMem``-s its own heap to it and maps the object at an address of its
   own (``cuMemMap``, ``cuMemSetAccess``); a store agreement: every rank has bound. Only after it
   does any rank release the object's handle (rank 0's, the creator's, included: its release
   before a peer's bind would leave the peer nothing to bind to).

Each agreement carries every rank's verdict: a driver call that fails on one rank (no fabric
manager, no resources) makes every rank release what it made of the object and go on with the
heap alone, the failing rank's reason named, instead of the others waiting out the timeout.

Release, per rank, in the reverse order: unmap and free the multicast address, unbind, release
the object; unmap every heap part, free the range, release every handle. A VMM allocation lives
until its last handle is released and its last mapping is gone, so no rank waits for another to
release its own.

Where VMM is missing (no cuda.bindings, a driver or GPU without it), the heap is a CUDA IPC
allocation of its own (``cudaIpcGetMemHandle``) instead, and the engine says so when the heap
opens (at the group's first ``gpucomm.empty``).
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
    "multicast_unavailable",
    "multicast_granularity",
    "open_vmm_heap",
    "bind_multicast",
    "VmmHeap",
    "VmmHeapRefused",
    "Multicast",
]

_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_ATTR_VMM = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_ATTR_POSIX_FD = 103  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
_ATTR_MULTICAST = 132  # CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
_MULTICAST_DRIVER = 12010  # cuMulticastCreate came with CUDA 12.1
_TAG_HEAP, _TAG_MULTICAST = 1, 2


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
    """ "rank r: reason" of the first rank in ``reasons`` (every local rank's, in rank order) that
    gave one; "" where none did."""
    return next((f"rank {r}: {reason}" for r, reason in enumerate(reasons) if reason), "")


def _attribute(driver: ModuleType, attribute: int, device: int) -> int:
    return int(
        _check(driver.cuDeviceGetAttribute(driver.CUdevice_attribute(attribute), device), "cuDeviceGetAttribute")
    )


@contextlib.contextmanager
def _on_device(driver: ModuleType, device: int) -> Iterator[None]:
    """``device``'s primary context (the one torch's runtime uses) current for the calls inside,
    the thread's own back after. The thread may hold another GPU's context (a process driving
    several GPUs; a release run by whichever thread drops the last tensor), in which these calls
    would act on the wrong GPU. The primary context stays retained: the heap's memory lives in it."""
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
    """``device``'s UUID in hex: one GPU reads the same in every process, whatever its ordinal
    there ("" where the driver cannot say)."""
    try:
        driver = _driver()
        _check(driver.cuInit(0), "cuInit")  # a query: no context needed
        return bytes(_check(driver.cuDeviceGetUuid(device), "cuDeviceGetUuid").bytes).hex()
    except (UnsupportedError, GpucommError):
        return ""


def multicast_unavailable(device: int, identities: list[str]) -> str:
    """Why this rank's GPU (``device``) cannot join the node's multicast object ("" if it can):
    ``identities`` is every local rank's :func:`gpu_identity`, in rank order. One line, as the
    engine gives it at init."""
    if "" in identities:
        return f"the driver did not say which GPU rank {identities.index('')} has (cuDeviceGetUuid)"
    if len(set(identities)) != len(identities):
        shared = sorted({i[:8] for i in identities if identities.count(i) > 1})
        return f"ranks share a GPU (UUID {', '.join(shared)}...): a multicast object takes each GPU once"
    try:
        driver = _driver()
        version = int(_check(driver.cuDriverGetVersion(), "cuDriverGetVersion"))
        if version < _MULTICAST_DRIVER:
            return f"the driver supports CUDA {version // 1000}.{version % 1000 // 10}, multicast needs 12.1"
        _check(driver.cuInit(0), "cuInit")  # a query: no context needed
        if not _attribute(driver, _ATTR_MULTICAST, device):
            return f"GPU {device} reports no CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (needs sm_90 or newer on NVSwitch)"
    except (UnsupportedError, GpucommError) as exc:
        return str(exc)
    return ""


def multicast_granularity(device: int, world_size: int, nbytes: int) -> int:
    """The size a heap bound to a multicast object of ``world_size`` GPUs must be a multiple of
    (``CU_MULTICAST_GRANULARITY_MINIMUM``: what creating and binding require; the recommended
    one is a performance hint, and reportedly far larger)."""
    driver = _driver()
    _check(driver.cuInit(0), "cuInit")  # a query: no context needed
    minimum = driver.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_MINIMUM
    return int(
        _check(
            driver.cuMulticastGetGranularity(_multicast_prop(driver, world_size, nbytes), minimum),
            "cuMulticastGetGranularity",
        )
    )


def _multicast_prop(driver: ModuleType, world_size: int, size: int) -> object:
    prop = driver.CUmulticastObjectProp()
    prop.numDevices = world_size
    prop.handleTypes = _POSIX_FD
    prop.flags = 0
    prop.size = size
    return prop


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
        """Unmap every part, free the range, release every handle (once), after the device has
        finished what it was doing (a kernel may still read a peer's heap)."""
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
    """Release calls that go on past a failure (what a stop would skip leaks: the heap is GiBs),
    the first failure raised once all have been tried."""

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
    """The driver refused a rank's part of the heap (no memory, an import it cannot take): every
    rank raises it at the same step, with that rank's reason, and the engine takes another heap."""


def open_vmm_heap(
    exchange: FdExchange,
    rank: int,
    world_size: int,
    device: int,
    nbytes: int,
    align: int = 1,
    agreed: Callable[[str, str], list[str]] | None = None,
) -> VmmHeap:
    """Create, share and map every rank's heap (module docstring); collective over the node. Its
    size is ``nbytes`` rounded up to the allocation granularity and to ``align`` (a power of two:
    the multicast granularity where the heap will be bound to a multicast object).

    ``agreed(stage, mine)`` (every local rank's ``mine`` at ``stage``, "" for done) settles each
    step: a driver refusal on any rank raises :class:`VmmHeapRefused` on every rank, naming it,
    instead of its peers waiting out the timeout for a descriptor that never comes. Without it
    (None) a refusal raises here alone."""
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


@dataclass
class Multicast:
    """This rank's multicast object over the heap, mapped at ``address``."""

    address: int
    size: int
    device: int
    _handle: object = None
    _bound: bool = False
    _reserved: bool = False
    _mapped: bool = False

    def release(self) -> None:
        """Undo what was made, in reverse (a set-up that stopped part-way releases its part)."""
        driver = _driver()
        with _on_device(driver, self.device):
            self._release(driver)

    def _release(self, driver: ModuleType) -> None:
        steps = _ReleaseSteps()
        if self._mapped:
            steps(driver.cuCtxSynchronize(), "cuCtxSynchronize")
            self._mapped = False
            steps(driver.cuMemUnmap(self.address, self.size), "cuMemUnmap")
        if self._reserved:
            self._reserved = False
            steps(driver.cuMemAddressFree(self.address, self.size), "cuMemAddressFree")
        if self._bound:
            self._bound = False
            steps(driver.cuMulticastUnbind(self._handle, self.device, 0, self.size), "cuMulticastUnbind")
        handle, self._handle = self._handle, None
        if handle is not None:
            steps(driver.cuMemRelease(handle), "cuMemRelease")
        steps.done()


def bind_multicast(
    exchange: FdExchange, agreed: Callable[[str, str], list[str]], rank: int, world_size: int, heap: VmmHeap
) -> tuple[Multicast | None, str]:
    """Create (rank 0), import, add every device, bind every heap, map (module docstring): the
    mapped object and "", or None and the first failing rank's reason, the same on every rank.
    ``agreed(stage, mine)`` returns every local rank's ``mine`` at ``stage`` ("" for done)."""
    driver = _driver()
    with _on_device(driver, heap.device):
        return _bind_multicast(driver, exchange, agreed, rank, world_size, heap)


def _bind_multicast(
    driver: ModuleType,
    exchange: FdExchange,
    agreed: Callable[[str, str], list[str]],
    rank: int,
    world_size: int,
    heap: VmmHeap,
) -> tuple[Multicast | None, str]:
    prop = _multicast_prop(driver, world_size, heap.size)
    mc = Multicast(address=0, size=heap.size, device=heap.device)
    fd = -1

    def settled(stage: str, failure: str) -> str:
        return first_reason(agreed(stage, failure))

    try:
        failure = ""
        if rank == 0:
            try:
                mc._handle = _check(driver.cuMulticastCreate(prop), "cuMulticastCreate")
                fd = int(
                    _check(
                        driver.cuMemExportToShareableHandle(mc._handle, driver.CUmemAllocationHandleType(_POSIX_FD), 0),
                        "cuMemExportToShareableHandle",
                    )
                )
            except GpucommError as exc:
                failure = str(exc)
        why = settled("mc_created", failure)
        if not why:
            failure = _import_and_add(driver, exchange, rank, world_size, mc, fd)
            why = settled("mc_added", failure)  # every device added before any bind
        if not why:
            failure = _bind_and_map(driver, heap, mc, prop)
            why = settled("mc_bound", failure)  # every rank bound: from here any rank may release its handle
    except BaseException:
        mc.release()
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    if why:
        mc.release()  # after the agreement: no rank binds to what another releases
        return None, why
    return mc, ""


def _import_and_add(
    driver: ModuleType, exchange: FdExchange, rank: int, world_size: int, mc: Multicast, fd: int
) -> str:
    """Rank 0 sends the object's descriptor, the others import it; every rank adds its GPU. The
    driver's refusal as text ("" for done)."""
    try:
        if rank == 0:
            exchange.send(list(range(1, world_size)), fd, _TAG_MULTICAST)
        else:
            received = exchange.receive([0], _TAG_MULTICAST)[0]
            try:
                mc._handle = _check(
                    driver.cuMemImportFromShareableHandle(received, driver.CUmemAllocationHandleType(_POSIX_FD)),
                    "cuMemImportFromShareableHandle",
                )
            finally:
                os.close(received)
        _check(driver.cuMulticastAddDevice(mc._handle, mc.device), "cuMulticastAddDevice")
    except GpucommError as exc:
        return str(exc)
    return ""


def _bind_and_map(driver: ModuleType, heap: VmmHeap, mc: Multicast, prop: object) -> str:
    """This rank's heap bound to the object, the object mapped at an address of its own ("" for
    done, else the driver's refusal)."""
    try:
        _check(driver.cuMulticastBindMem(mc._handle, 0, heap.own_handle, 0, heap.size, 0), "cuMulticastBindMem")
        mc._bound = True
        recommended = driver.CUmulticastGranularity_flags.CU_MULTICAST_GRANULARITY_RECOMMENDED
        # Alignment only: address space is plentiful, and the recommended granularity suits any mapping.
        granularity = int(_check(driver.cuMulticastGetGranularity(prop, recommended), "cuMulticastGetGranularity"))
        mc.address = int(_check(driver.cuMemAddressReserve(heap.size, granularity, 0, 0), "cuMemAddressReserve"))
        mc._reserved = True
        _check(driver.cuMemMap(mc.address, heap.size, 0, mc._handle, 0), "cuMemMap")
        mc._mapped = True
        _check(driver.cuMemSetAccess(mc.address, heap.size, [_access(driver, heap.device)], 1), "cuMemSetAccess")
    except GpucommError as exc:
        return str(exc)
    return ""
