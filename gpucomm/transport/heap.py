"""The symmetric heap: memory that every local rank has mapped, handed out as ordinary tensors.

Each rank of a node owns one heap of ``nbytes`` bytes, and every rank maps every peer's heap
into its own address space. The memory is the heap's own, opened at the first call that needs
it (gpucomm.transport.heap_open): on a GPU from the driver's virtual-memory API, or a CUDA IPC
allocation where that is missing; on the CPU a shared-memory segment.

An allocation is collective and symmetric: every rank calls :meth:`SymmetricHeap.empty` with the
same size, in the same order, and gets a tensor at the same offset of its own heap, checked
through the store (ranks that ask for different sizes get :class:`CommMismatchError` naming
them). So a tensor of rank r at heap offset o has a copy on every rank p at ``bases[p] + o``: a
collective on it reads the peers' copies in place, and a kernel (gpucomm.language) can name any
peer's element from the table of bases alone.

What a device kernel or another layer needs is small and stays stable:

- ``bases``: int64 tensor on the heap's device, ``bases[p]`` = address of rank p's heap here;
- ``rank``, ``world_size``, ``nbytes``, ``device``;
- :meth:`offset` of a tensor's first byte (any view inside the heap), :meth:`contains`,
  :meth:`peer` (rank p's copy of a tensor, same shape, strides and dtype).

Freeing. A symmetric tensor's storage holds a small owner object; when the last tensor or view
sharing that storage is gone, the owner's finalizer queues its block. Each allocation tells the
other ranks (through the store) which blocks this rank has dropped, and returns to the free list
only the blocks that every rank has dropped, before it searches (first fit, in offset order): a
tensor that lives a little longer on one rank (a reference cycle the garbage collector reaches
later there) delays the reuse of its block, never the symmetry of the next one. Views and slices
are ordinary tensors of the same storage: they keep the block alive, and a contiguous slice is
itself symmetric (its offset is the same on every rank that slices alike, and collectives check
that it is).

Closing: :meth:`SymmetricHeap.close` is part of its communicator's close. Memory that tensors
still use stays mapped until they are gone: the owners keep the mapping alive (the shared-memory
segment on the CPU, the virtual-memory mapping on a GPU). The one exception is a GPU heap that
is a CUDA IPC allocation (where the virtual-memory API is missing): its close frees the memory
(once every peer has unmapped it), so its symmetric tensors must be gone by then (the engine
warns if they are not).
"""

from __future__ import annotations

import bisect
import collections
import datetime
import weakref
from collections.abc import Callable, Sequence

import torch

from gpucomm.errors import CommMismatchError, CommTimeoutError, GpucommError, UnsupportedError
from gpucomm.ops.contract import alias_bytes

__all__ = ["SymmetricHeap", "FreeList", "StoreAgreement", "HEAP_ALIGN"]

# Every block starts at a multiple of 512 bytes, as torch's CUDA caching allocator aligns its
# blocks: full 16-byte vectors for the kernels, and cache lines of their own for every tensor.
HEAP_ALIGN = 512


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


class FreeList:
    """First-fit allocator of ``nbytes`` bytes in ``HEAP_ALIGN`` units.

    Deterministic: the same calls in the same order give the same offsets on every rank.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []  # (offset, size), by offset
        self.live: dict[int, int] = {}  # offset -> size of every block handed out

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a block of at least ``nbytes`` bytes, or None if none is free."""
        size = _round_up(max(1, nbytes), HEAP_ALIGN)
        for i, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, free - size)
                self.live[offset] = size
                return offset
        return None

    def release(self, offset: int) -> None:
        """Return the block at ``offset`` and merge it with free neighbours."""
        size = self.live.pop(offset)
        i = bisect.bisect(self._free, (offset, size))
        if i < len(self._free) and self._free[i][0] == offset + size:
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            offset, size = self._free[i - 1][0], self._free[i - 1][1] + size
            i -= 1
            self._free.pop(i)
        self._free.insert(i, (offset, size))

    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)


class StoreAgreement:
    """One allocation's agreement through the store: the blocks dropped on every rank.

    Rank r sets ``{prefix}heap/{n}/{r}`` to ``nbytes;offsets`` for its n-th allocation (the size it
    asks for, and the blocks whose tensors it has dropped since they were handed out), waits for
    every rank's, and returns the blocks dropped on every rank.

    Raises CommMismatchError where a rank asks for another size. Each rank deletes its key of the
    previous allocation first: every rank has read it by then, since a rank sets its n-th key only
    after it has read all the (n-1)-th ones.
    """

    def __init__(self, store: object, prefix: str, rank: int, world_size: int, timeout: float) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.count = 0

    def __call__(self, nbytes: int, dropped: set[int]) -> set[int]:
        n, self.count = self.count, self.count + 1
        if self.world_size == 1:
            return set(dropped)
        keys = [f"{self.prefix}heap/{n}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], f"{nbytes};{','.join(map(str, sorted(dropped)))}".encode())
        try:
            self.store.wait(keys, datetime.timedelta(seconds=self.timeout))
        except RuntimeError as exc:  # torch raises DistStoreError or a plain RuntimeError on expiry
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            if not missing:
                raise
            raise CommTimeoutError(
                op="empty",
                epoch=None,
                rank=self.rank,
                missing=missing,
                timeout=self.timeout,
                detail=f"allocation {n} of the symmetric heap: every rank must call gpucomm.empty, in the same order",
            ) from exc
        seen = [self.store.get(key).decode().split(";") for key in keys]
        if n > 0:
            self.store.delete_key(f"{self.prefix}heap/{n - 1}/{self.rank}")
        differ = [r for r, (size, _) in enumerate(seen) if int(size) != nbytes]
        if differ:
            listed = ", ".join(f"rank {r}: {size}" for r, (size, _) in enumerate(seen))
            raise CommMismatchError(
                f"gpucomm.empty: allocation {n} of the symmetric heap asks for different sizes on different ranks "
                f"(bytes: {listed}); every rank must allocate the same sizes in the same order",
                op="empty",
                epoch=None,
                rank=self.rank,
                peers=differ,
            )
        common = set(dropped)
        for _, offsets in seen:
            common &= {int(o) for o in offsets.split(",") if o}
        return common


class _Owner:
    """What a symmetric tensor's storage holds; its finalizer frees the block.

    It holds the block's address for torch, and whatever keeps the mapping alive (``keep``).
    """

    def __init__(self, addr: int, nbytes: int, device: torch.device, keep: object) -> None:
        self.keep = keep
        interface = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}
        if device.type == "cuda":
            interface["stream"] = None  # the memory is ready: nothing to order against
            self.__cuda_array_interface__ = interface
        else:
            self.__array_interface__ = interface


def _tensor_over(owner: _Owner, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the owner's bytes whose storage holds the owner."""
    if device.type == "cuda":
        # Not torch.as_tensor: it takes the device from the pointer, which for a peer's heap mapped
        # here is the peer's GPU, and would copy to this one (alias_bytes checks it does not).
        addr, nbytes = owner.__cuda_array_interface__["data"][0], owner.__cuda_array_interface__["shape"][0]
        return alias_bytes(addr, nbytes, device, owner=owner)
    import numpy

    return torch.from_numpy(numpy.asarray(owner))


class SymmetricHeap:
    """One rank's view of a node's symmetric heap (module docstring).

    Args:
        rank: this rank on the node; world_size: ranks on the node.
        device: where the heap lives (cpu: shared memory; cuda: this rank's GPU).
        bases: address of every rank's heap in this process.
        nbytes: bytes of each rank's heap.
        agree: called with the size of each allocation and the blocks dropped here; returns the
            blocks dropped on every rank, or raises when ranks ask for different sizes.
        keep: an object that keeps the mapping of every heap alive (a view of it); the owners of
            live blocks hold it too.
        release: unmaps and frees the heap; called once, when the heap is closed and no block is
            live any more (None: the workspace it lives in does that).
        kind: how the heap is mapped ("workspace": shm or CUDA IPC buffers; "vmm": the driver's
            virtual-memory API).
        reserve: bytes at offset 0 kept for gpucomm (the multimem signal pad).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        bases: Sequence[int],
        nbytes: int,
        agree: Callable[[int, set[int]], set[int]],
        keep: object = None,
        release: Callable[[], None] | None = None,
        kind: str = "workspace",
        reserve: int = 0,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.nbytes = nbytes
        self.kind = kind  # how the heap is mapped: "workspace" (shm / CUDA IPC) or "vmm"
        self.base_addrs = tuple(int(b) for b in bases)
        self.bases = torch.tensor(self.base_addrs, dtype=torch.int64).to(device)
        self._agree = agree
        self._blocks = FreeList(nbytes)
        # The first ``reserve`` bytes are gpucomm's own (the multimem barrier's signal pad, at
        # offset 0 of every rank's heap), never handed out.
        self._reserved = bool(reserve)
        if reserve:
            self._blocks.allocate(reserve)
        self._freed: collections.deque[int] = collections.deque()  # appended by finalizers, any thread
        self._dropped: set[int] = set()  # blocks dropped here, not yet by every rank
        self._mapping = _Mapping(keep, release)
        self._closed = False

    # -- allocation ---------------------------------------------------------------------------
    def empty(self, size: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``size`` and ``dtype`` in this rank's heap (collective).

        Raises GpucommError once the heap is closed, UnsupportedError where the heap has no free block
        that large (the same on every rank), and CommMismatchError where ranks ask for other sizes.
        """
        if self._closed:
            raise GpucommError("gpucomm.empty: the symmetric heap is closed (its communicator was destroyed)")
        numel = 1
        for s in size:
            numel *= s
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        while self._freed:  # appended by finalizers: moved here, in this thread, before it is read
            self._dropped.add(self._freed.popleft())
        # Only blocks every rank has dropped go back: a tensor may live a little longer on one
        # rank than on another (a reference cycle the garbage collector has not reached yet).
        for offset in sorted(self._agree(nbytes, self._dropped)):
            self._dropped.discard(offset)
            self._blocks.release(offset)
        offset = self._blocks.allocate(nbytes)
        if offset is None:  # the same on every rank: their free lists are the same
            raise UnsupportedError(
                f"gpucomm.empty: {nbytes} bytes do not fit the symmetric heap ({self.nbytes} bytes per rank, "
                f"largest free block {self._blocks.largest_free()}); raise GPUCOMM_HEAP_BYTES"
            )
        owner = _Owner(self.base_addrs[self.rank] + offset, max(nbytes, 1), self.device, self._mapping)
        weakref.finalize(owner, self._freed.append, offset)
        self._mapping.blocks += 1
        weakref.finalize(owner, self._mapping.block_gone)
        raw = _tensor_over(owner, self.device)[:nbytes]
        return raw.view(dtype).view(tuple(size))

    # -- what kernels and algorithms ask --------------------------------------------------------
    def offset(self, tensor: torch.Tensor) -> int:
        """Bytes from this rank's heap base to ``tensor``'s first element (ValueError outside)."""
        if not self.contains(tensor):
            raise ValueError(
                f"SymmetricHeap.offset: the tensor at {tensor.data_ptr():#x} is not in this rank's symmetric heap"
            )
        return tensor.data_ptr() - self.base_addrs[self.rank]

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether every byte ``tensor`` spans (first to last element) lies in this rank's heap."""
        if self._closed or tensor.device.type != self.device.type or tensor.numel() == 0:
            return False
        start = tensor.data_ptr()
        last = start + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) * tensor.element_size()
        base = self.base_addrs[self.rank]
        return base <= start and last + tensor.element_size() <= base + self.nbytes

    def peer(self, tensor: torch.Tensor, peer: int) -> torch.Tensor:
        """Rank ``peer``'s copy of the symmetric ``tensor``: same shape, strides and dtype.

        Raises ValueError for a peer out of range or a tensor outside this rank's heap.
        """
        if not 0 <= peer < self.world_size:
            raise ValueError(f"SymmetricHeap.peer: peer must be in [0, {self.world_size}), got {peer}")
        offset = self.offset(tensor)
        span = tensor.element_size() * (1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())))
        owner = _Owner(self.base_addrs[peer] + offset, span, self.device, self._mapping)
        self._mapping.blocks += 1  # the view keeps the mapping as a block does
        weakref.finalize(owner, self._mapping.block_gone)
        raw = _tensor_over(owner, self.device)
        return raw.view(tensor.dtype).as_strided(tensor.shape, tensor.stride())

    @property
    def live_blocks(self) -> int:
        """Blocks handed out whose tensors are not all gone yet (the reserve not counted)."""
        return len(self._blocks.live) - (1 if self._reserved else 0) - len(self._freed) - len(self._dropped)

    # -- life cycle -----------------------------------------------------------------------------
    def close(self) -> None:
        """No allocation after this; the mapping goes once no symmetric tensor uses it."""
        if self._closed:
            return
        self._closed = True
        self._mapping.close()

    def __repr__(self) -> str:
        return (
            f"SymmetricHeap(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
            f"nbytes={self.nbytes}, kind={self.kind!r}, live_blocks={self.live_blocks}"
            f"{', closed' if self._closed else ''})"
        )


class _Mapping:
    """Keeps the heap's memory mapped while the heap is open or any of its blocks is live.

    It calls ``release`` once neither is, and only once.
    """

    def __init__(self, keep: object, release: Callable[[], None] | None) -> None:
        self.keep = keep
        self.blocks = 0
        self._release = release
        self._open = True

    def block_gone(self) -> None:
        self.blocks -= 1
        self._maybe_release()

    def close(self) -> None:
        self._open = False
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self._open or self.blocks > 0:
            return
        release, self._release = self._release, None
        self.keep = None
        if release is not None:
            release()
