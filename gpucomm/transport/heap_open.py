"""Opening a node's symmetric heap: where its memory comes from, decided the same on every rank.

The heap opens at the first call that needs it (gpucomm.workspace.engine.Engine.open_heap), never at a
communicator's init, and is memory of its own, never part of the workspace:

- The CPU: a shared-memory segment per rank, made as the workspace's are (every page reserved
  at creation: a /dev/shm without room is WorkspaceUnavailableError on every rank, at once,
  never a SIGBUS later) (:func:`heap_of_its_own`).
- A GPU with the driver's virtual-memory API (and cuda.bindings): its own allocation, shared as a
  file descriptor and mapped by every rank (:func:`vmm_heap`, gpucomm.transport.vmm), bound to
  a multicast object (gpucomm.transport.multicast) where every GPU of the node supports one.
- A GPU without it: a CUDA IPC allocation of its own (``cudaIpcGetMemHandle``), as on the CPU;
  :func:`heap_kind` returns the one-line reason the engine logs when the heap opens.

Every choice that must be the same on every rank is agreed through the store
(:func:`agree`): a rank whose GPU lacks VMM or multicast makes every rank take the fallback.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable

import torch

from gpucomm.errors import CommTimeoutError, GpucommError
from gpucomm.transport.heap import SymmetricHeap
from gpucomm.transport.opening import open_workspace
from gpucomm.transport.workspace import Workspace

__all__ = ["agree", "heap_kind", "heap_of_its_own", "vmm_heap", "open_vmm_parts"]


def agree(
    store: object, prefix: str, rank: int, world_size: int, timeout: float, mine: str, what: str = "symmetric heap open"
) -> list[str]:
    """Every local rank's ``mine`` (this one's included), once all have set theirs.

    Raises CommTimeoutError for ``what`` naming the ranks that did not set theirs within ``timeout``.
    """
    keys = [f"{prefix}{r}" for r in range(world_size)]
    store.set(keys[rank], mine.encode())
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            raise
        raise CommTimeoutError(what, None, rank, missing, timeout, detail=f"no {prefix!r} from them") from exc
    return [store.get(key).decode() for key in keys]


def heap_kind(device: torch.device, agreed: Callable[[str], list[str]]) -> tuple[str, str]:
    """("vmm", "") where every rank's GPU gives the heap from the virtual-memory API, else ("workspace", why).

    ``agreed(mine)`` returns every rank's string (:func:`agree`).
    """
    if device.type != "cuda":
        return "workspace", ""
    from gpucomm.transport.vmm import first_reason, vmm_unavailable

    why = first_reason(
        agreed(vmm_unavailable(device.index if device.index is not None else torch.cuda.current_device()))
    )
    return ("workspace", why) if why else ("vmm", "")


def heap_of_its_own(
    transport: str,
    store: object,
    prefix: str,
    rank: int,
    world_size: int,
    device: torch.device,
    nbytes: int,
    agree_alloc: object,
    reserve: int,
    timeout: float,
) -> tuple[SymmetricHeap, Workspace]:
    """The heap as a workspace of its own, and that workspace (closing it frees the memory).

    The workspace has ``nbytes`` bytes of data and no flags per rank, over ``transport`` ("shm":
    /dev/shm segments; "cuda_ipc": cudaMalloc'd buffers). On a GPU its close is collective.

    Raises:
        WorkspaceUnavailableError: as :func:`gpucomm.transport.open_workspace`, on every rank.
    """
    workspace = open_workspace(
        transport,
        store=store,
        prefix=prefix + "ws/",
        rank=rank,
        world_size=world_size,
        data_bytes=nbytes,
        flag_count=0,
        device=device,
        timeout=timeout,
        size_knob="GPUCOMM_HEAP_BYTES",
        views_keep_memory=True,  # never unmapped under a symmetric tensor the caller holds
    )
    try:
        regions = [workspace.data(p, 0, nbytes) for p in range(world_size)]
        # The regions' views keep the shared-memory mappings alive while symmetric tensors do.
        keep = [r.bytes for r in regions]
        heap = SymmetricHeap(
            rank,
            world_size,
            workspace.device,
            [r.addr for r in regions],
            nbytes,
            agree_alloc,
            keep=keep,
            reserve=reserve,
        )
    except BaseException:
        workspace.close()
        raise
    return heap, workspace


def vmm_heap(
    store: object,
    prefix: str,
    rank: int,
    world_size: int,
    device: torch.device,
    nbytes: int,
    agree_alloc: object,
    reserve: int,
    timeout: float,
) -> tuple[SymmetricHeap, int, str]:
    """(heap, multicast address, reason): the heap from the virtual-memory API.

    The multicast address is 0 without a multicast object, and the reason says why there is none
    ("" when there is).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    mapping, multicast, release, why = open_vmm_parts(store, prefix, rank, world_size, index, nbytes, timeout)
    try:
        heap = SymmetricHeap(
            rank,
            world_size,
            device,
            mapping.bases,
            mapping.size,
            agree_alloc,
            release=release,
            kind="vmm",
            reserve=reserve,
        )
    except BaseException:
        release()
        raise
    return heap, 0 if multicast is None else multicast.address, why


def open_vmm_parts(
    store: object, prefix: str, rank: int, world_size: int, index: int, nbytes: int, timeout: float
) -> tuple[object, object, Callable[[], None], str]:
    """The driver side of :func:`vmm_heap`: (heap, multicast object or None, release, reason).

    Maps every rank's heap, binds the multicast object where every rank's GPU takes one (else None
    and the first failing rank's reason), and returns the release of both. It makes no torch
    tensor, so the driver double runs it.

    Raises:
        VmmHeapRefused: the driver refused a rank's part of the heap; every rank raises it at the
            same step, with that rank's reason (the engine then takes a heap of its own).
    """
    from gpucomm.transport import multicast as mc_object
    from gpucomm.transport import vmm
    from gpucomm.transport.fdpass import FdExchange

    exchange = FdExchange(store, prefix, rank, world_size, timeout)
    mapping = multicast = None
    try:
        # Agreed before any heap is made: whether a multicast object will bind the heaps, and so
        # the multicast granularity their size must be a multiple of.
        identities = agree(store, prefix + "device/", rank, world_size, timeout, vmm.gpu_identity(index))
        mine, granularity = mc_object.multicast_unavailable(index, identities), 1
        if not mine:
            try:
                granularity = mc_object.multicast_granularity(index, world_size, nbytes)
            except GpucommError as exc:
                mine = str(exc)
        verdicts = [
            json.loads(v)
            for v in agree(
                store,
                prefix + "multicast/",
                rank,
                world_size,
                timeout,
                json.dumps({"why": mine, "granularity": granularity}),
            )
        ]
        why = vmm.first_reason([v["why"] for v in verdicts])
        align = 1 if why else max(v["granularity"] for v in verdicts)

        def agreed(stage: str, mine: str) -> list[str]:
            return agree(store, f"{prefix}{stage}/", rank, world_size, timeout, mine)

        mapping = vmm.open_vmm_heap(exchange, rank, world_size, index, nbytes, align=align, agreed=agreed)
        if not why:
            multicast, why = mc_object.bind_multicast(exchange, agreed, rank, world_size, mapping)
    except BaseException:
        if mapping is not None:
            mapping.release()
        exchange.close()
        raise

    def release() -> None:
        try:
            if multicast is not None:
                multicast.release()
        finally:
            mapping.release()
            exchange.close()

    return mapping, multicast, release, why
