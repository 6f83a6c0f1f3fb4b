"""How many channels (thread blocks) the program kernel runs: the flag layout's count, fixed per
communicator, and each launch's, chosen by the size of its program.

A channel is one block that runs every instruction of a program on its share of the bytes and
syncs only with the same channel of the other ranks (:mod:`gpucomm.program`). The flag layout
has :func:`layout_channels` channels; a launch may run fewer (:func:`launch_channels`): channel
c then also keeps the epochs of channels c + grid, c + 2 * grid, ... (the kernels store them), so
every channel counts every SYNC, and every rank derives the grid from the same program.

The table below is reasoned, not measured: it awaits a GPU measurement (docs/performance.md
gives the model; docs/results/ will hold the runs).
"""

from __future__ import annotations

import torch

__all__ = ["layout_channels", "launch_channels", "MAX_CHANNELS", "BYTES_PER_CHANNEL"]

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


def layout_channels(knob: int, kernels: str, device: torch.device, world_size: int) -> int:
    """Channels of the flag layout: ``knob`` (GPUCOMM_CHANNELS) when set, 1 for the host
    executor and under the interpreter (it runs channels one after the other: more buy
    nothing), else a quarter of the SMs shared by the ranks on this GPU, at most MAX_CHANNELS."""
    if kernels == "torch":
        return 1
    if knob:
        return knob
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    # Ranks of the node spread over its visible GPUs; one process per GPU gives 1.
    ranks_here = -(-world_size // max(1, torch.cuda.device_count()))
    return max(1, min(MAX_CHANNELS, sms // (_SMS_PER_CHANNEL * ranks_here)))


def launch_channels(extent: int, channels: int) -> int:
    """The grid of a program that uses ``extent`` bytes of a half, out of ``channels``: one per
    BYTES_PER_CHANNEL, at least one."""
    return max(1, min(channels, -(-extent // BYTES_PER_CHANNEL)))
