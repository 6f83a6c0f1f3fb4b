"""The node's multicast object (NVLink SHARP) over the symmetric heap: :func:`bind_multicast`.

Needs every GPU of the node to report ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``
(:func:`multicast_unavailable`) and no two ranks to share a GPU, told apart by UUID
(:func:`gpucomm.transport.vmm.gpu_identity`), which is the same in every process whatever the
GPU's ordinal there. The heap's size is then a multiple of :func:`multicast_granularity` too,
agreed before any heap is made. Then, on every local rank:

1. rank 0 creates the object for P devices and sends its descriptor to every peer, which imports
   it;
2. every rank adds its GPU; a store agreement: the driver requires every device before the first
   bind;
3. every rank binds its own heap (:class:`gpucomm.transport.vmm.VmmHeap`) and maps the object at
   an address of its own; a store agreement: only after every rank has bound does any rank
   release the object's handle (a creator's release before a peer's bind would leave the peer
   nothing to bind to).

Each agreement carries every rank's verdict: a driver call that fails on one rank (no fabric
manager, no resources) makes every rank release what it made of the object and go on with the
heap alone, naming the failing rank's reason, instead of the others waiting out the timeout.
Release, per rank, in reverse order: unmap and free the address, unbind, release the handle.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from gpucomm.errors import GpucommError, UnsupportedError
from gpucomm.transport.fdpass import FdExchange
from gpucomm.transport.vmm import (
    _POSIX_FD,
    VmmHeap,
    _access,
    _attribute,
    _check,
    _driver,
    _on_device,
    _ReleaseSteps,
    first_reason,
)

__all__ = ["multicast_unavailable", "multicast_granularity", "bind_multicast", "Multicast"]

_ATTR_MULTICAST = 132  # CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
_MULTICAST_DRIVER = 12010  # cuMulticastCreate came with CUDA 12.1
_TAG_MULTICAST = 2  # the fd exchange's tag for the object's descriptor (the heap's is 1)


def multicast_unavailable(device: int, identities: list[str]) -> str:
    """Why this rank's GPU (``device``) cannot join the node's multicast object, in one line; "" if it can.

    ``identities``: every local rank's :func:`gpucomm.transport.vmm.gpu_identity`, in rank order.
    """
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
    """The size a heap bound to a multicast object of ``world_size`` GPUs must be a multiple of.

    That is ``CU_MULTICAST_GRANULARITY_MINIMUM``, what creating and binding require; the recommended
    one is a performance hint, and reportedly far larger.
    """
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
    """Set up the node's multicast object over ``heap`` (module docstring); collective over the node.

    Returns the mapped object and "", or None and the first failing rank's reason, the same on
    every rank. ``agreed(stage, mine)`` returns every local rank's ``mine`` at ``stage`` ("" for
    done).
    """
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
    """Share the object and add this rank's GPU; the driver's refusal as text, "" for done.

    Rank 0 sends the object's descriptor, the others import it.
    """
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
    """Bind this rank's heap to the object and map the object here; the driver's refusal, "" for done."""
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
