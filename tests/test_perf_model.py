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
