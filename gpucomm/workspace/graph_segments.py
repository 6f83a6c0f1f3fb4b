"""Where a tensor's memory comes from, and the peers' segments opened once each by their handle.

A collective captured into a CUDA graph on an ordinary tensor (not one of ``gpucomm.empty``) can
run in place on the users' own tensors, as vLLM's custom all-reduce does, once every rank has
mapped the others' memory. What a rank can share is a whole allocation, not a tensor:

- on a GPU, the caching allocator's segment holding the tensor (``torch.cuda.memory_snapshot``:
  its base, size and device), shared by ``cudaIpcGetMemHandle`` of its base. A segment made with
  expandable segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``) has no such handle,
  nor has memory of another device than the communicator's: those keep the copy path.
- on the CPU, the shared mapping of a named /dev/shm file that holds the tensor
  (``/proc/self/maps``), shared by its path; anonymous memory (an ordinary CPU tensor) or an
  unlinked file cannot be opened by a peer, and keeps the copy path.

:class:`Allocation` is what a capture records: the segment and the tensor's offset in it, or why
it cannot be shared. :meth:`Allocation.handle` names the segment for a peer (taken after the
capture, never inside it); :class:`OpenedSegments` opens each peer handle once, keyed by the
handle, never by an address (the allocator hands the same address to another segment once the
first is freed), and releases them all together.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from gpucomm.errors import GpucommError

__all__ = ["Allocation", "locate", "OpenedSegments"]

_SHM = "/dev/shm/"


@dataclasses.dataclass(frozen=True)
class Allocation:
    """The segment ``[base, base + size)`` holding a tensor at ``base + offset``; ``reason`` says
    why it cannot be shared ("" where it can). ``kind`` is "cuda" or "shm"; ``name`` the /dev/shm
    path of a CPU segment."""

    kind: str
    base: int
    size: int
    offset: int
    reason: str = ""
    name: str = ""
    device_index: int = -1

    def handle(self) -> bytes:
        """What a peer opens this segment by: the CUDA IPC handle of its base, or the shm path
        with the file's identity (device and inode, so that a recreated file is another handle)."""
        if self.reason:
            raise GpucommError(f"Allocation.handle: this segment cannot be shared: {self.reason}")
        if self.kind == "shm":
            st = os.stat(self.name)
            return f"shm:{st.st_dev}:{st.st_ino}:{self.size}:{self.name}".encode()
        import cupy

        with cupy.cuda.Device(self.device_index):
            return b"cuda:" + bytes(cupy.cuda.runtime.ipcGetMemHandle(self.base))


def locate(addr: int, device: torch.device) -> Allocation:
    """The allocation of a tensor at ``addr`` on ``device`` (the communicator's workspace's)."""
    if device.type == "cuda":
        return _cuda_segment(addr, device)
    return _shm_segment(addr)


def _cuda_segment(addr: int, device: torch.device) -> Allocation:
    index = torch.cuda.current_device() if device.index is None else device.index
    try:
        on = torch.cuda.memory.memory_snapshot()
    except RuntimeError as exc:  # pragma: no cover - the allocator is torch's own
        return Allocation("cuda", 0, 0, 0, f"torch's caching allocator gives no segments: {exc}")
    return _in_segments(on, addr, index)


def _in_segments(segments: list[dict], addr: int, index: int) -> Allocation:
    """The segment of ``segments`` (``torch.cuda.memory_snapshot``'s form) that holds ``addr``.
    A tensor on another device than the communicator's is in none of that device's segments."""
    for seg in segments:
        base, size = seg["address"], seg["total_size"]
        if seg.get("device") == index and base <= addr < base + size:
            if seg.get("is_expandable", False):
                why = "its segment is an expandable segment, which has no CUDA IPC handle"
                return Allocation("cuda", base, size, addr - base, why, device_index=index)
            return Allocation("cuda", base, size, addr - base, device_index=index)
    return Allocation("cuda", 0, 0, 0, f"no segment of torch's caching allocator on cuda:{index} holds the tensor")


def _shm_segment(addr: int) -> Allocation:
    """The /dev/shm file mapped shared at ``addr`` in this process (``/proc/self/maps``)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if not start <= addr < end:
                continue
            path = fields[5].strip() if len(fields) > 5 else ""
            if not path.startswith(_SHM) or "s" not in fields[1]:
                return Allocation("shm", 0, 0, 0, "the tensor is not in a shared mapping of a /dev/shm file")
            if path.endswith(" (deleted)"):
                return Allocation("shm", 0, 0, 0, f"its shared-memory file {path} is unlinked: no peer can open it")
            size = os.stat(path).st_size
            # The mapping's file offset plus the tensor's place in it: the tensor's byte in the file.
            offset = int(fields[2], 16) + addr - start
            return Allocation("shm", 0, size, offset, name=path)
    return Allocation("shm", 0, 0, 0, "no mapping of this process holds the tensor")


class OpenedSegments:
    """Peer segments opened in this process, each once, keyed by its handle, with the graphs that
    use each: a segment closes when the last graph using it lets it go (:meth:`drop`), or when
    everything is released (the communicator closes). Graphs captured over the same buffers (one
    per batch size, say) share one opening: CUDA opens an allocation once per process."""

    def __init__(self) -> None:
        self._open: dict[bytes, tuple[int, object]] = {}
        self._users: dict[bytes, int] = {}
        self.opens = 0  # handles opened so far (the tests count them)

    def __len__(self) -> int:
        return len(self._open)

    def take(self, handle: bytes) -> int:
        """The base address in this process of the segment ``handle`` names, opened at its first
        use; one more user of it until :meth:`drop`."""
        got = self._open.get(handle)
        if got is None:
            got = self._open[handle] = _open(handle)
            self.opens += 1
        self._users[handle] = self._users.get(handle, 0) + 1
        return got[0]

    def drop(self, handle: bytes) -> None:
        """One user fewer of ``handle``'s segment: closed with its last user."""
        users = self._users.get(handle, 0) - 1
        if users > 0:
            self._users[handle] = users
            return
        self._users.pop(handle, None)
        opened = self._open.pop(handle, None)
        if opened is not None:
            _close(handle, *opened)

    def release(self) -> None:
        """Close every segment opened here; idempotent."""
        opened, self._open, self._users = self._open, {}, {}
        for handle, (addr, keeper) in opened.items():
            _close(handle, addr, keeper)


def _close(handle: bytes, addr: int, keeper: object) -> None:
    if handle.startswith(b"shm:"):
        keeper.release(evict=True)  # type: ignore[attr-defined]
    else:
        import cupy

        cupy.cuda.runtime.ipcCloseMemHandle(addr)


def _open(handle: bytes) -> tuple[int, object]:
    if handle.startswith(b"shm:"):
        from gpucomm.transport.mapping import Mapping

        _, _, _, size, path = handle.decode().split(":", 4)
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = Mapping(fd, int(size))
        finally:
            os.close(fd)
        return mapping.addr, mapping
    if handle.startswith(b"cuda:"):
        import cupy

        # cudaIpcMemLazyEnablePeerAccess, as the workspace's own buffers open (transport.cuda_ipc).
        return cupy.cuda.runtime.ipcOpenMemHandle(handle[5:], 1), None
    raise GpucommError(f"OpenedSegments.address: expected a handle starting b'shm:' or b'cuda:', got {handle[:8]!r}")
