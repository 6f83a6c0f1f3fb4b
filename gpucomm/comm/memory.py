"""A communicator's symmetric memory: tensors every rank of a node has mapped at one offset.

The heap opens, collectively, at the first call that needs it (:meth:`SymmetricMemory.empty`,
``mem_pool``, ``heap``); its memory and layout are :mod:`gpucomm.transport.heap`'s.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gpucomm.comm.route import Router
from gpucomm.errors import UnsupportedError
from gpucomm.transport.heap import SymmetricHeap
from gpucomm.transport.pool import SymmetricPool
from gpucomm.workspace.engine import Engine
from gpucomm.workspace.repeat import Repeats

__all__ = ["SymmetricMemory"]


class SymmetricMemory(Router):
    """The symmetric heap's calls of :class:`gpucomm.comm.communicator.Communicator` (its base)."""

    store: dist.Store
    device: torch.device | None
    _repeat: Repeats

    def empty(self, *size: object, dtype: torch.dtype | None = None, device: object = None) -> torch.Tensor:
        """A tensor (``torch.empty``'s arguments) in the node's symmetric heap: an ordinary torch
        tensor whose memory every rank of the node has mapped, at the same offset on every rank.

        Collective: every rank of this communicator calls it with the same size and dtype, in
        the same order as its other allocations (ranks that differ raise CommMismatchError).
        The first call opens the heap (GPUCOMM_HEAP_BYTES per rank; nothing of it exists
        before): where the host has no room for it (a small /dev/shm) every rank raises
        WorkspaceUnavailableError, and the communicator's collectives go on working.
        Collectives on such a tensor (all_reduce: two-shot) read the peers' copies in place,
        with no copy through the workspace; any other tensor takes the usual path. A contiguous
        slice of a symmetric tensor is symmetric too when every rank slices alike. The memory is
        freed when the last tensor or view of it is gone (gpucomm.transport.heap).

        Args:
            size: ints, or one sequence of them, as torch.empty takes.
            dtype: default ``torch.get_default_dtype()``.
            device: ``"cpu"`` or this rank's GPU; default this rank's GPU where it has one, else
                the CPU (whose heap is shared memory).

        Example::

            grad = comm.empty(4096, dtype=torch.bfloat16)
            grad.copy_(local_grad)
            comm.all_reduce(grad)   # reads every rank's grad where it is
        """
        self._check_usable("empty")
        shape = _shape_of(size, "empty")
        dtype = torch.get_default_dtype() if dtype is None else dtype
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"gpucomm.empty: dtype must be a torch.dtype, got {type(dtype).__name__}")
        where = torch.device(device) if device is not None else (self.device or torch.device("cpu"))
        if where.type == "cuda" and self.device is not None and where.index is None:
            where = self.device
        engine = self._engines.get(where.type)
        if engine is None:
            raise UnsupportedError(
                f"gpucomm.empty: {where.type} tensors of this group are served by gloo, which has no symmetric heap "
                "(on one host, GPUCOMM_TRANSPORT=auto or shm serves CPU tensors from shared memory)"
            )
        if where.type == "cuda" and where != engine.device:
            raise ValueError(f"gpucomm.empty: device must be this rank's GPU {engine.device}, got {where}")
        heap = self._engine_heap(engine, "empty")
        if heap is None:
            raise UnsupportedError(
                f"gpucomm.empty: this group has no symmetric heap for {where.type} tensors (GPUCOMM_HEAP_BYTES=0)"
            )
        return heap.empty(shape, dtype)

    def mem_pool(self, nbytes: int, device: object = None) -> SymmetricPool:
        """A pool of ``nbytes`` of the node's symmetric heap whose ``mem_pool()`` is a
        ``torch.cuda.MemPool``: ``with torch.cuda.use_mem_pool(pool.mem_pool()):`` puts torch's
        allocations (gradient buckets, activations) in the heap, at the same offsets on every rank
        that allocates alike (gpucomm.transport.pool). Collective; one per process.

        Example::

            pool = comm.mem_pool(256 << 20)
            with torch.cuda.use_mem_pool(pool.mem_pool()):
                grads = torch.empty(4096, device="cuda")
            pool.check()                 # collective: every rank allocated alike
            comm.all_reduce(grads)       # in place, as on a tensor of comm.empty
        """
        self._check_usable("mem_pool")
        heap = self._open_heap(device, "mem_pool")
        if heap is None:
            raise UnsupportedError(
                "gpucomm.mem_pool: this group has no symmetric heap for that device (see gpucomm.empty)"
            )
        engine = self._engines[heap.device.type]
        return SymmetricPool(heap, nbytes, self.store, engine.heap_prefix, self.timeout)

    def heap(self, device: object = None) -> SymmetricHeap | None:
        """The symmetric heap of ``device``'s tensors on this rank's node (None without one):
        its table of every rank's base address, for kernels that address peers (gpucomm.language).
        Collective the first time (it opens the heap, as :meth:`empty` does)."""
        return self._open_heap(device, "heap")

    def _open_heap(self, device: object, fn: str) -> SymmetricHeap | None:
        where = torch.device(device) if device is not None else (self.device or torch.device("cpu"))
        engine = self._engines.get(where.type)
        return None if engine is None else self._engine_heap(engine, fn)

    def _engine_heap(self, engine: Engine, fn: str) -> SymmetricHeap | None:
        """``engine``'s heap, opened now if it was not (collective, :meth:`Engine.open_heap`)."""
        if engine.heap is not None:
            return engine.heap
        heap = engine.open_heap(fn)
        # The heap's memory is new, maybe at addresses where ordinary tensors lay before: the
        # launches kept for them (gpucomm.workspace.repeat, keyed by address) took the ordinary path, and
        # a symmetric tensor there must take its own.
        self._repeat.clear()
        return heap


def _shape_of(size: tuple, fn: str) -> tuple[int, ...]:
    """torch.empty's size arguments (ints, or one sequence of ints) as a tuple of ints."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    for s in size:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"gpucomm.{fn}: size must be non-negative ints, got {size!r}")
    return tuple(size)
