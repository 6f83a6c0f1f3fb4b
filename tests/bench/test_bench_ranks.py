"""bench/ranks.py's spawn_ranks: every rank's result back; a rank that dies without one is named at
once (not after the timeout), a silent one after the timeout, and the other ranks are ended."""

from __future__ import annotations

import queue
import time

import pytest
from bench_rank_targets import give_rank_times_ten, last_rank_dies, never_answer

from gpucomm._bench.ranks import RankDied, spawn_ranks


def test_every_ranks_result_comes_back() -> None:
    assert spawn_ranks(give_rank_times_ten, 3, timeout=120) == {0: 0, 1: 10, 2: 20}


def test_a_rank_that_dies_is_named_well_before_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankDied, match=r"rank 1 ended with exit code 3 and no result \(ranks without one: \[0, 1\]\)"):
        spawn_ranks(last_rank_dies, 2, timeout=600)
    # The surviving rank sleeps 120 s: raising well before that means it was not waited for.
    assert time.monotonic() - start < 60


def test_a_silent_rank_times_out() -> None:
    start = time.monotonic()
    with pytest.raises(queue.Empty, match=r"ranks \[0, 1\] gave no result within 3 s"):
        spawn_ranks(never_answer, 2, timeout=3)
    assert time.monotonic() - start < 60
