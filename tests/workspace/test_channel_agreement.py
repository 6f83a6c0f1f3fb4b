"""Ranks agree on the channels of the flag layout when the workspace opens: each rank computes its
count itself (GPUCOMM_CHANNELS, or the GPU's SMs over the ranks on it), and a byte must belong to
the same channel on every rank, so ranks that differ raise CommMismatchError at init, every one of
them, naming each rank's count. The buffers' sizes alone did not show it: the flag area is padded
to whole pages, so 2 and 1 channels at 2 ranks gave the same buffer."""

from __future__ import annotations

from spawn import run_ranks

ENV = {"TRITON_INTERPRET": "1"}


def _init(rank: int, world_size: int, channels: list[int]) -> str:
    import gpucomm

    try:
        gpucomm.init_process_group(transport="shm", kernels="triton", channels=channels[rank], timeout=30)
    except gpucomm.CommMismatchError as err:
        return str(err)
    gpucomm.destroy_process_group()
    return ""


def test_ranks_with_different_channel_counts_raise_at_init_on_every_rank() -> None:
    for message in run_ranks(_init, 2, [2, 1], timeout=300, env=ENV):
        assert "channels: rank 0 has 2, rank 1 has 1" in message, message


def test_ranks_with_one_channel_count_open_the_workspace() -> None:
    assert run_ranks(_init, 2, [2, 2], timeout=300, env=ENV) == ["", ""]
