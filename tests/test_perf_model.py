"""The counts behind docs/performance.md: what gpucomm's all_reduce programs move at 8 ranks, as
bench/model.py counts them, against the textbook costs of each algorithm."""

from __future__ import annotations

import pytest

from gpucomm._bench.model import count

HALF = 3 << 20  # the default workspace's half


@pytest.mark.parametrize("nbytes", [32 << 10, 2 << 20])
def test_each_algorithm_moves_what_its_textbook_cost_says(nbytes: int) -> None:
    P = 8
    oneshot, twoshot, ring = (count(a, nbytes, P, HALF) for a in ("oneshot", "twoshot", "ring"))
    assert (oneshot["syncs"], oneshot["link_bytes"]) == (1, (P - 1) * nbytes)
    assert (twoshot["syncs"], twoshot["link_bytes"]) == (2, 2 * (P - 1) * nbytes // P)
    assert (ring["syncs"], ring["link_bytes"]) == (2 * (P - 1), 2 * (P - 1) * nbytes // P)


def test_small_messages_run_one_channel_and_large_ones_many() -> None:
    assert count("oneshot", 8, 8, HALF)["grid"] == 1
    assert count("twoshot", 1 << 30, 8, HALF)["grid"] == 32
    # 1 GiB in 3 MiB pieces: one SYNC per piece for one-shot.
    assert count("oneshot", 1 << 30, 8, HALF)["syncs"] == -(-(1 << 30) // HALF)


def test_symmetric_two_shot_moves_the_same_bytes_with_three_syncs_and_no_copy() -> None:
    P = 8
    for nbytes in (32 << 10, 1 << 30):
        inplace = count("twoshot", nbytes, P, HALF, symmetric=True)
        assert inplace["syncs"] == 3
        assert inplace["link_bytes"] == 2 * (P - 1) * nbytes // P
        # Its own slice read and written by the reduce, every other slice written by the gather.
        assert inplace["local_bytes"] == 2 * nbytes // P + (P - 1) * nbytes // P
        assert inplace["copy_in_bytes"] == 0
    assert count("twoshot", 1 << 30, P, HALF)["copy_in_bytes"] == 1 << 30
    assert count("twoshot", 1 << 30, P, HALF, symmetric=True)["grid"] == 32


def test_the_gpus_default_workspace_is_the_smallest_whose_syncs_take_under_six_percent() -> None:
    import argparse

    from gpucomm._bench.model import sync_share
    from gpucomm.config import DEFAULT_WORKSPACE_BYTES

    p = argparse.Namespace(world=8, launch_us=3.0, sync_us=3.0, link_gbs=450.0, multimem_gbs=309.0, hbm_gbs=3000.0, saturating_grid=16)
    chosen = DEFAULT_WORKSPACE_BYTES["cuda"]
    assert sync_share(chosen, p) < 0.06 <= sync_share(chosen // 2, p)
