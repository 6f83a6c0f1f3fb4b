"""Which ranks of a node share this rank's GPU, and the channel count that follows.

A GPU is known by its UUID, not by the ordinal a process calls it: with ``CUDA_VISIBLE_DEVICES``
set per rank (SLURM, Kubernetes, torchrun setups) every rank calls its GPU 0, and with every GPU
visible rank r calls GPU r r. Counting the visible devices therefore says nothing of how many
ranks share a GPU; the ranks' UUIDs, exchanged through the store once at init, do. The channel
count (:func:`gpucomm.workspace.channels.layout_channels`) divides the GPU's SMs by that number,
so one rank per GPU gets the same count whatever each process can see, and the workspace
handshake then checks that every rank came to the same one.
"""

from __future__ import annotations

import torch

from gpucomm.transport.heap_open import agree
from gpucomm.workspace.channels import layout_channels

__all__ = ["gpu_uuid", "ranks_on_gpu", "node_channels"]


def gpu_uuid(device: torch.device) -> str:
    """The UUID of the physical GPU ``device`` names in this process."""
    return str(torch.cuda.get_device_properties(device).uuid)


def ranks_on_gpu(store: object, prefix: str, rank: int, world_size: int, timeout: float, uuid: str) -> int:
    """How many of the ``world_size`` ranks (this one included) have the GPU ``uuid``: each rank
    sets its own under ``prefix`` and reads every rank's.

    Raises CommTimeoutError naming the ranks that did not set theirs within ``timeout``.
    """
    if not uuid:
        raise ValueError(f"ranks_on_gpu: uuid must be a GPU's UUID, got {uuid!r}")
    return agree(store, prefix, rank, world_size, timeout, uuid, what="GPU identification").count(uuid)


def node_channels(
    knob: int,
    kernels: str,
    device: torch.device,
    store: object,
    prefix: str,
    rank: int,
    world_size: int,
    timeout: float,
) -> int:
    """The flag layout's channels for this rank: :func:`layout_channels` with the ranks on this
    rank's physical GPU. Only a count from the SMs needs the exchange (one store round trip)."""
    if kernels == "torch" or knob or device.type != "cuda":
        return layout_channels(knob, kernels, device, 1)
    sharing = ranks_on_gpu(store, prefix, rank, world_size, timeout, gpu_uuid(device))
    return layout_channels(knob, kernels, device, sharing)
