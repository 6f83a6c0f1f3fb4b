"""How many blocks of a launch a GPU holds at once, and how many spinning blocks it can take
while another launch still gets a block in.

A block that spins on a flag holds its SM's registers, threads, shared memory and block slot
until the flag arrives. If the flag is set by a block of another launch (another rank's, on the
same GPU) and spinning blocks fill every SM first, that block is never scheduled: a deadlock.
Blocks that never wait always end, so the waited-for launch needs only *one* free place on *one*
SM to make progress. This module computes that bound from what a block of each kernel takes:

- :func:`blocks_per_sm`: the CUDA occupancy rule (the least of the limits by registers, threads,
  shared memory and block slots);
- :func:`blocks_to_shut`: the fewest spinning blocks on one SM that leave no room for one
  block of the waited-for kernel;
- :func:`spinning_capacity`: the most spinning blocks a device holds with room left somewhere
  for a waited-for block: ``sms * blocks_to_shut - 1``;
- :func:`spinning_grid`: a rank's share of it when ``ranks`` ranks share the GPU.

Limits default to an H100 SXM (sm_90: 132 SMs, 64 K registers, 2048 threads, 32 blocks and
228 KiB of shared memory per SM, 227 KiB per block), as the CUDA programming guide's table of
compute capability 9.0 gives them; :func:`limits_of` reads a GPU's own where there is one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Footprint",
    "SMLimits",
    "H100",
    "blocks_per_sm",
    "blocks_to_shut",
    "spinning_capacity",
    "spinning_grid",
    "limits_of",
]


@dataclass(frozen=True)
class Footprint:
    """What one block of a compiled kernel takes: ``threads`` (32 x num_warps), ``registers``
    per thread (ptxas's count) and ``shared`` bytes (static plus the launch's dynamic)."""

    threads: int
    registers: int
    shared: int


@dataclass(frozen=True)
class SMLimits:
    """A GPU's SM count and per-SM limits, with the allocation granularity of sm_80 and sm_90."""

    sms: int = 132
    registers: int = 64 * 1024
    threads: int = 2048
    blocks: int = 32
    shared: int = 228 * 1024
    shared_per_block: int = 227 * 1024
    register_unit: int = 256  # registers go to a warp in units of 256
    shared_unit: int = 128  # shared memory goes to a block in units of 128 bytes
    shared_reserved: int = 1024  # and 1 KiB more per block, the system's (sm_80 and later)


H100 = SMLimits()


def _usage(block: Footprint, limits: SMLimits) -> tuple[int, int, int, int]:
    """(registers, threads, shared bytes, block slots) one block holds on an SM."""
    warps = -(-block.threads // 32)
    per_warp = -(-block.registers * 32 // limits.register_unit) * limits.register_unit
    shared = -(-block.shared // limits.shared_unit) * limits.shared_unit + limits.shared_reserved
    return warps * per_warp, warps * 32, shared, 1


def _capacity(limits: SMLimits) -> tuple[int, int, int, int]:
    return limits.registers, limits.threads, limits.shared, limits.blocks


def _check(block: Footprint, limits: SMLimits, fn: str) -> None:
    if block.threads <= 0 or block.registers < 0 or block.shared < 0:
        raise ValueError(f"gpucomm.ops.residency.{fn}: a footprint of positive threads, got {block}")
    if block.threads > 1024 or block.registers > 255 or block.shared > limits.shared_per_block:
        raise ValueError(
            f"gpucomm.ops.residency.{fn}: a block of at most 1024 threads, 255 registers and "
            f"{limits.shared_per_block} bytes of shared memory, got {block}"
        )


def blocks_per_sm(block: Footprint, limits: SMLimits = H100) -> int:
    """Blocks of one kernel an SM holds at once: the least of its limits."""
    _check(block, limits, "blocks_per_sm")
    return min(cap // use for cap, use in zip(_capacity(limits), _usage(block, limits)))


def blocks_to_shut(spinning: Footprint, waited: Footprint, limits: SMLimits = H100) -> int | None:
    """The fewest ``spinning`` blocks on one SM that leave too little of some resource for one
    ``waited`` block; None if no number of them that fits on the SM does."""
    _check(spinning, limits, "blocks_to_shut")
    _check(waited, limits, "blocks_to_shut")
    use, need = _usage(spinning, limits), _usage(waited, limits)
    if any(n > cap for cap, n in zip(_capacity(limits), need)):
        raise ValueError(f"gpucomm.ops.residency.blocks_to_shut: {waited} does not fit an empty SM of {limits}")
    # k blocks shut the SM in a resource when capacity - k * use < need.
    k = min((cap - n) // u + 1 for cap, u, n in zip(_capacity(limits), use, need))
    return k if k <= blocks_per_sm(spinning, limits) else None


def spinning_capacity(spinning: Footprint, waited: Footprint, limits: SMLimits = H100) -> int | None:
    """The most ``spinning`` blocks resident on a device, placed in any way, that still leave
    one SM with room for a ``waited`` block; None if any number does."""
    k = blocks_to_shut(spinning, waited, limits)
    return None if k is None else limits.sms * k - 1


def spinning_grid(work: int, spinning: Footprint, waited: Footprint, ranks: int, limits: SMLimits = H100) -> int:
    """The grid of a launch of ``spinning`` blocks that share ``work`` items (a persistent grid
    looping over them) when ``ranks`` ranks launch one each on the GPU: at most ``work``, and
    together never so many that a ``waited`` block finds no place."""
    if work < 1 or ranks < 1:
        raise ValueError(f"gpucomm.ops.residency.spinning_grid: work and ranks >= 1, got {work} and {ranks}")
    capacity = spinning_capacity(spinning, waited, limits)
    if capacity is None:
        return work
    if capacity < ranks:
        raise ValueError(
            f"gpucomm.ops.residency.spinning_grid: {ranks} ranks on a GPU of {limits.sms} SMs leave less "
            f"than one spinning block each ({capacity} in all for {spinning} waiting on {waited})"
        )
    return min(work, capacity // ranks)


def limits_of(device: object) -> SMLimits:
    """The SM count and per-SM limits of CUDA ``device`` (torch's properties); block slots and
    the per-block shared memory cap stay an H100's where torch does not report them."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return SMLimits(
        sms=props.multi_processor_count,
        registers=getattr(props, "regs_per_multiprocessor", H100.registers),
        threads=getattr(props, "max_threads_per_multi_processor", H100.threads),
        shared=getattr(props, "shared_memory_per_multiprocessor", H100.shared),
        shared_per_block=getattr(props, "shared_memory_per_block_optin", H100.shared_per_block),
    )
