"""The bench's buffers: allocated once per rank and reused by every size, round and backend.

nccl-tests allocates its send and receive buffers once, at the largest size, and every row
uses the front of them. The bench does the same: a rank holds one send and one receive buffer,
each allocated at the largest size asked before the first row, and every collective, size,
round, backend and variant takes a view of its front.

Why it matters on a CPU: torch's CPU allocator caches nothing, and a buffer of 128 KiB or more
freed and allocated again may come from mmap/munmap, whose first touch faults its pages in again.
On the 2-core CI machine (CPU wall clock, load average 3.7-5.7), ``copy_`` + gpucomm's in-place
all_reduce of 1 MiB into an output allocated afresh for each call took 265-556 us against 200-279
us into one reused, with 3-15 page faults a call against none (docs/results/2026-11-29-bench-oop/,
calls_*.txt, variants oop_fresh and oop). The bench's timed calls never allocated (at most 1 of
200 calls per size from 256 KiB to 4 MiB had a fault: faults_per_timed_call.txt there); it
allocated its buffers afresh for each round and variant, before the warm-up. Now they are
allocated once, as nccl-tests does, and ``allocations`` counts them.
"""

from __future__ import annotations

import torch

__all__ = ["Buffers", "ROLES"]

# send: what a rank sends from (out-of-place inputs); recv: what a collective writes (in-place
# buffers and out-of-place outputs), as nccl-tests' sendbuff and recvbuff.
ROLES = ("send", "recv")


class Buffers:
    """One rank's send and receive buffers on ``device``, viewed as each row's tensors."""

    def __init__(self, device: torch.device, reserve_bytes: int = 0) -> None:
        if reserve_bytes < 0:
            raise ValueError(f"Buffers: expected reserve_bytes >= 0, got {reserve_bytes}")
        self.device = device
        self.allocations = 0  # how many times a buffer was allocated (one per role when reserved)
        self._bytes: dict[str, torch.Tensor] = {}
        if reserve_bytes:
            for role in ROLES:
                self._grow(role, reserve_bytes)

    def _grow(self, role: str, nbytes: int) -> torch.Tensor:
        self._bytes[role] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.allocations += 1
        return self._bytes[role]

    def take(self, role: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The front ``numel`` elements of ``role``'s buffer as ``dtype`` (grown first if too small).

        Views of one role alias each other: a caller takes at most one of each role per
        measurement, and resets it before timing (``Prepared.reset``).
        """
        if role not in ROLES:
            raise ValueError(f"Buffers.take: expected a role in {ROLES}, got {role!r}")
        if numel < 0:
            raise ValueError(f"Buffers.take: expected numel >= 0, got {numel}")
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        buf = self._bytes.get(role)
        if buf is None or buf.numel() < nbytes:
            buf = self._grow(role, nbytes)
        return buf[:nbytes].view(dtype)

    def addresses(self) -> dict[str, int]:
        """Each role's buffer address: the same from the first row to the last where nothing grew."""
        return {role: buf.data_ptr() for role, buf in self._bytes.items()}
