"""A ``torch.cuda.MemPool`` over the symmetric heap: tensors a model allocates as usual, symmetric.

``with torch.cuda.use_mem_pool(pool):`` sends torch's allocations (gradient buckets, activations)
to torch's caching allocator with gpucomm's allocator underneath: its segments come from one block
of the node's symmetric heap, handed out first fit by ``kernels/host/heap_pool.c`` through
``torch.cuda.memory.CUDAPluggableAllocator``. Ranks that run the same program ask for the same
segments in the same order, so each tensor lies at the same heap offset on every rank, and a
collective reads it in place as it reads a tensor of ``gpucomm.empty``. :meth:`SymmetricPool.check`
(collective) compares every rank's sequence of pool calls and raises CommMismatchError where
they differed; a collective on a tensor whose offsets differ raises it too (the offset is part of
the call's fingerprint).

Only a GPU shows the MemPool working (torch's CPU builds have no CUDA allocator to plug into):
on the CPU the pool's block and its allocator are built and tested, and :meth:`SymmetricPool.mem_pool`
says why there is no MemPool. One pool per process: the allocator's functions take no context.
"""

from __future__ import annotations

import torch

from gpucomm.errors import CommMismatchError, GpucommError, UnsupportedError
from gpucomm.toolchain import native
from gpucomm.transport.heap import SymmetricHeap
from gpucomm.transport.heap_open import agree

__all__ = ["SymmetricPool"]

_ALLOC, _FREE = "gpucomm_heap_malloc", "gpucomm_heap_free"
_configured: list[SymmetricPool] = []  # the process's one pool (kernels/host/heap_pool.c has one region)


class SymmetricPool:
    """``nbytes`` of ``heap`` for a MemPool (collective: every rank of the node builds it).

    Args:
        heap: the node's symmetric heap.
        nbytes: bytes of the block the pool's segments come from.
        store, prefix, timeout: where :meth:`check` compares the ranks' sequences.
    """

    def __init__(self, heap: SymmetricHeap, nbytes: int, store: object, prefix: str, timeout: float) -> None:
        self.lib = native.load("heap_pool")
        if self.lib is None:
            raise UnsupportedError(
                "gpucomm.mem_pool: kernels/host/heap_pool.c could not be built here "
                "(a C compiler and Python's headers are needed)"
            )
        if _configured:
            raise UnsupportedError(
                "gpucomm.mem_pool: this process has a symmetric pool already (one per process); close it first"
            )
        self.heap = heap
        self.block = heap.empty((nbytes,), torch.uint8)  # collective: the same offset on every rank
        self.lib.configure(self.block.data_ptr(), nbytes)
        self._store, self._prefix, self._timeout = store, prefix, timeout
        self._checks = 0
        self._pool: object = None
        _configured.append(self)

    def mem_pool(self) -> object:
        """The ``torch.cuda.MemPool`` whose allocations come from this pool's block (made once).

        Raises UnsupportedError where the heap is not on a CUDA device.
        """
        if self._pool is not None:
            return self._pool
        if self.heap.device.type != "cuda" or not torch.cuda.is_available():
            raise UnsupportedError(
                f"gpucomm.mem_pool: torch.cuda.MemPool needs CUDA, and this heap is on {self.heap.device} "
                f"(torch {torch.__version__}, CUDA available: {torch.cuda.is_available()})"
            )
        allocator = torch.cuda.memory.CUDAPluggableAllocator(self.lib.__file__, _ALLOC, _FREE)
        self._pool = torch.cuda.MemPool(allocator.allocator())
        return self._pool

    def state(self) -> tuple[int, int, int]:
        """(live segments, their bytes, the hash of every allocation and free so far)."""
        _, live, live_bytes, digest = self.lib.state()
        return live, live_bytes, digest

    def check(self) -> None:
        """Collective: raise CommMismatchError if the ranks' pool calls have differed so far."""
        self._checks += 1
        segments, nbytes, digest = self.state()
        mine = f"{segments:d},{nbytes:d},{digest:d}"
        seen = agree(
            self._store,
            f"{self._prefix}pool/{self._checks}/",
            self.heap.rank,
            self.heap.world_size,
            self._timeout,
            mine,
        )
        differ = [r for r, s in enumerate(seen) if s != mine]
        if differ:
            raise CommMismatchError(
                "gpucomm.mem_pool: the ranks' pools differ (live segments, bytes, hash: "
                + ", ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
                + "): tensors allocated from it are not at the same offsets on every rank; "
                "allocate the same tensors in the same order",
                op="mem_pool",
                epoch=None,
                rank=self.heap.rank,
                peers=differ,
            )

    def close(self) -> None:
        """Give the region back to the heap, once torch's pool holds none of its segments.

        Raises:
            GpucommError: segments are still out (torch's caching allocator keeps what a MemPool
                got until it is emptied, after its tensors are gone): giving the block back then
                would let the heap hand out memory the MemPool still hands to tensors. The pool
                stays as it was; free the tensors, drop the MemPool and ``torch.cuda.empty_cache()``,
                then close again.
        """
        if self in _configured:
            live, live_bytes, _ = self.state()
            if live:
                raise GpucommError(
                    f"gpucomm.mem_pool: close: torch's MemPool still holds {live} segment(s) of this pool "
                    f"({live_bytes} bytes), expected 0: free the tensors allocated in it, drop the MemPool "
                    "and call torch.cuda.empty_cache() first"
                )
            _configured.remove(self)
            self.lib.configure(0, 0)
        self._pool = None
        self.block = None
