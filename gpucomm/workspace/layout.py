"""The byte layout of an engine's workspace, and what one rank's segment of it takes.

One place for the arithmetic that the engine lays its workspace out by (gpucomm.workspace.engine) and that
``python -m gpucomm.env`` quotes when it says how many ranks a /dev/shm holds: a second formula
there would drift from the real one. It imports nothing heavier than torch.

Layout of one rank's workspace (its flag area, then its data area)::

    flags: [sync flags: channels x P | p2p "data ready": P | p2p "consumed": P | state |
            device API: bank (slots x P) | device state | identity: 2 x channels x P x IDENT_WORDS]
    data:  [p2p mailboxes (a quarter) | half 0 | half 1 | device stage: 2 x half / 2]

The symmetric heap is not part of it: it is a segment (or allocation) of its own, opened at the
first call that needs it (gpucomm.workspace.engine.Engine.open_heap).
"""

from __future__ import annotations

import torch

from gpucomm.language import layout as device_layout
from gpucomm.ops.instruction_set import IDENT_WORDS
from gpucomm.transport.workspace import buffer_layout
from gpucomm.workspace.channels import layout_channels

__all__ = ["ALIGN", "STAGE_HALF_MAX", "DataLayout", "FlagLayout", "cpu_segment_bytes", "segment_bytes"]

ALIGN = 256  # every half starts 256-byte aligned: full 16-byte vectors for the kernels
_P2P_SHARE = 4  # the mailboxes take 1/_P2P_SHARE of the data area
# A half of the device API's stage holds 256 tokens of hidden 8192 in bf16 (4 MiB), the largest
# all_reduce_residual_rmsnorm of tensor-parallel decoding, in one piece; larger buffers (an
# all_gather_matmul's shards) come from the symmetric heap.
STAGE_HALF_MAX = 4 << 20


class FlagLayout:
    """Indices of the int64 words in a rank's flag area (module docstring).

    Sync flag c * P + p is channel c's flag written by rank p; state is [poison, epoch of channel
    0, ..., epoch of channel C-1], written only by the owner; the device API (gpucomm.language)
    has a bank and state of its own, which the program kernel never touches
    (gpucomm/language/layout.py). Identity slot (parity, c, p) holds the identity words that
    rank p stored beside channel c's flag at its last SYNC of that epoch parity
    (gpucomm.ops.program, "Identity").
    """

    def __init__(self, world_size: int, channels: int) -> None:
        self.world_size = world_size
        self.channels = channels
        self.p2p_ready = channels * world_size
        self.p2p_done = self.p2p_ready + world_size
        self.state = self.p2p_done + world_size  # poison, then the epoch of every channel
        # The device API's own words (gpucomm.language.layout): its errors poison only them.
        self.device_bank = self.state + 1 + channels
        self.device_state = self.device_bank + device_layout.bank_words(world_size)
        self.identity = self.device_state + device_layout.state_words()
        self.count = self.identity + 2 * channels * world_size * IDENT_WORDS

    def sync_flag(self, channel: int, writer: int) -> int:
        return channel * self.world_size + writer

    def identity_slot(self, parity: int, channel: int, writer: int) -> int:
        """The first of the IDENT_WORDS words that ``writer`` stores beside channel ``channel``'s
        flag at epochs of ``parity``."""
        return self.identity + ((parity * self.channels + channel) * self.world_size + writer) * IDENT_WORDS

    def epoch(self, channel: int) -> int:
        return self.state + 1 + channel


class DataLayout:
    """The parts of a rank's data area for a workspace knob of ``workspace_bytes``.

    In order: the send/recv mailboxes (a quarter), two halves that collectives alternate between,
    and the device API's stage (gpucomm.language.stage). The stage comes after the halves and is its
    own, so that kernels written with the API never write where a program's peers may still read.
    The stage's halves are half a program's half, at most STAGE_HALF_MAX: what one-shot kernels
    serve is small.
    """

    def __init__(self, workspace_bytes: int) -> None:
        self.p2p_bytes = workspace_bytes // _P2P_SHARE // ALIGN * ALIGN
        self.half_bytes = (workspace_bytes - self.p2p_bytes) // 2 // ALIGN * ALIGN
        self.stage_half_bytes = min(self.half_bytes // 2, STAGE_HALF_MAX) // ALIGN * ALIGN

    @property
    def stage_start(self) -> int:
        return self.p2p_bytes + 2 * self.half_bytes

    @property
    def data_bytes(self) -> int:
        """Bytes of the whole data area."""
        return self.stage_start + 2 * self.stage_half_bytes


def segment_bytes(workspace_bytes: int, world_size: int, channels: int) -> int:
    """Bytes of one rank's workspace buffer: the flag area padded to whole pages, then the data area.

    The buffer is its /dev/shm segment on the CPU, its cudaMalloc on a GPU.
    """
    flags = FlagLayout(world_size, channels)
    return buffer_layout(DataLayout(workspace_bytes).data_bytes, flags.count)[1]


def cpu_segment_bytes(workspace_bytes: int, kernels: str, channels_knob: int, world_size: int) -> int:
    """:func:`segment_bytes` of a CPU (shared-memory) workspace, its channels chosen as the engine would.

    The engine chooses them with gpucomm.workspace.channels.layout_channels.
    """
    channels = layout_channels(channels_knob, kernels, torch.device("cpu"), 1)  # no GPU to share
    return segment_bytes(workspace_bytes, world_size, channels)
