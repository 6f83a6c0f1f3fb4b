"""How many channels (thread blocks) the program kernel runs, and which bytes each one moves.

A channel is one block that runs every instruction of a program on its share of the bytes and
syncs only with the same channel of the other ranks (:mod:`gpucomm.ops.program`).

- :func:`layout_channels`: the flag layout's count, fixed per communicator.
- :func:`launch_channels`: each launch's count, chosen by the size of its program; it may be
  fewer than the layout's. Channel c then also keeps the epochs of channels c + grid,
  c + 2 * grid, ... (the kernels store them), so every channel counts every SYNC, and every rank
  derives the grid from the same program.
- :func:`granule`: which share is a channel's own. In-half positions are dealt out round-robin
  in granules (granule g to channel g % grid); a granule is a 1/P share of the half's extent
  over the grid, so every instruction (a two-shot's 1/P slice as much as a whole piece) spans
  about grid granules or more, and every channel gets its share of it.
- :func:`shares`: counts those shares, for the tests and the performance model.

The table below is reasoned, not measured: it awaits a GPU measurement (docs/performance.md
gives the model; docs/results/ will hold the runs).
"""

from __future__ import annotations

import torch

__all__ = [
    "layout_channels",
    "launch_channels",
    "granule",
    "shares",
    "MAX_CHANNELS",
    "BYTES_PER_CHANNEL",
    "MIN_GRANULE",
]

# At most 32 channels: a quarter of an H100's 132 SMs, the share the large-message path of a
# communication library can take beside the compute it overlaps with (NCCL runs one block per
# channel too; its channel count on 8 x H100 is to be read with NCCL_DEBUG=INFO on a lent GPU).
MAX_CHANNELS = 32
# SMs per channel: every rank sharing a GPU must have all its channels resident at once (their
# waits spin), and a quarter of the SMs is the most a rank takes.
_SMS_PER_CHANNEL = 4
# A channel gets at least this many bytes of a program's half: below it, more channels add a
# sync (a flag round trip of a few microseconds over NVLink, per the model) to move what one
# channel moves in about as long (64 KiB at ~14 GB/s, 450 GB/s shared by 32 channels, is 4.7 us).
# So a small message runs one channel, and 2 MiB or more run MAX_CHANNELS.
BYTES_PER_CHANNEL = 64 << 10
# A granule is never smaller than one 16-byte vector per thread of a 256-thread channel: below
# it a channel's threads idle through each granule. A grid of g > 1 channels has an extent over
# (g - 1) x BYTES_PER_CHANNEL, so its 1/P granule reaches this floor only from P = 16 ranks.
MIN_GRANULE = 4 << 10
_ALIGN = 16


def layout_channels(knob: int, kernels: str, device: torch.device, ranks_on_gpu: int) -> int:
    """Channels of the flag layout: ``knob`` (GPUCOMM_CHANNELS) when set, else from the host and GPU.

    1 for the host executor and under the interpreter (they run channels one after the other: more
    buy nothing); else a quarter of the SMs shared by the ``ranks_on_gpu`` ranks on this physical
    GPU (gpucomm.workspace.gpu_share counts them by UUID), at most MAX_CHANNELS: 32 for one rank
    on an H100's 132 SMs, 16 for two, 4 for eight.
    """
    if ranks_on_gpu < 1:
        raise ValueError(f"layout_channels: ranks_on_gpu must be at least 1, got {ranks_on_gpu}")
    if kernels == "torch":
        return 1
    if knob:
        return knob
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_CHANNELS, sms // (_SMS_PER_CHANNEL * ranks_on_gpu)))


def launch_channels(extent: int, channels: int) -> int:
    """The grid of a program that uses ``extent`` bytes of a half, out of ``channels``.

    One channel per BYTES_PER_CHANNEL, at least one.
    """
    return max(1, min(channels, -(-extent // BYTES_PER_CHANNEL)))


def granule(extent: int, grid: int, world: int = 1) -> int:
    """Bytes of the in-half positions a channel owns in turn: granule g belongs to channel g % grid.

    For a program that uses ``extent`` bytes of a half, on ``grid`` channels, among ``world`` ranks:
    a 1/world share of the extent over the grid, in whole 16-byte vectors and at least MIN_GRANULE.
    An instruction of a 1/world slice (a two-shot's or a direct reduce-scatter's) then spans about
    ``grid`` granules, a whole piece about ``world`` x ``grid``, and every channel gets its share of
    each. A program that works outside the halves (in place on a symmetric tensor) passes its
    largest instruction as ``extent`` and ``world`` 1.

    It depends only on what every rank's program of one call shares (the extent, the grid, the
    world size): a byte at a given in-half position belongs to the same channel on every rank.
    An instruction of ``m`` granules gives each channel ``m // grid`` or one more, even to
    within about one granule a channel (tests/workspace/test_channel_balance.py).
    """
    if grid <= 1:
        return max(_ALIGN, -(-extent // _ALIGN) * _ALIGN)
    return max(MIN_GRANULE, extent // world // grid // _ALIGN * _ALIGN)


def shares(pos: int, nbytes: int, grid: int, granule_bytes: int) -> list[int]:
    """Bytes of ``[pos, pos + nbytes)`` each of ``grid`` channels moves (the kernels' rule)."""
    out = [0] * grid
    if nbytes <= 0:
        return out
    end = pos + nbytes
    first, last = pos // granule_bytes, (end - 1) // granule_bytes
    whole_turns, rest = divmod(last - first + 1, grid)
    for i in range(grid):
        out[(first + i) % grid] = whole_turns * granule_bytes
    for i in range(rest):
        out[(first + whole_turns * grid + i) % grid] += granule_bytes
    out[first % grid] -= pos - first * granule_bytes  # the first granule starts at pos
    out[last % grid] -= (last + 1) * granule_bytes - end  # the last ends at end
    return out
