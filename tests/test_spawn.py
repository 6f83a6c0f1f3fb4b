"""The spawn harness itself: results, failures, hangs, allowed exits, environment."""

from __future__ import annotations

import os
import signal
import time

import pytest
from spawn import RanksFailed, run_ranks


def _identity(rank, world_size, token):
    return {
        "rank": rank,
        "world_size": world_size,
        "token": token,
        "env": {
            k: os.environ[k]
            for k in (
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "GPUCOMM_TEST_KNOB",
            )
        },
        "pid": os.getpid(),
    }


def _fail_on_rank1(rank, world_size):
    if rank == 1:
        raise KeyError("deliberate failure on rank one")
    return rank


def _hang_on_rank1(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return rank


def _fail0_hang1(rank, world_size):
    if rank == 0:
        raise RuntimeError("rank zero gives up")
    time.sleep(600)


def _kill_self_on_rank1(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank * 10


def _exit_on_rank0(rank, world_size):
    if rank == 0:
        os._exit(3)
    return rank


def test_returns_values_and_env():
    token = os.urandom(8).hex()
    results = run_ranks(_identity, 3, token, timeout=60, env={"GPUCOMM_TEST_KNOB": token})
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world_size"] == 3 and r["token"] == token for r in results)
    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for r in results:
        env = r["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(r["rank"])
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["GPUCOMM_TEST_KNOB"] == token
    assert len({r["pid"] for r in results} | {os.getpid()}) == 4


def test_reports_failing_rank_traceback():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_fail_on_rank1, 3, timeout=60)
    err = info.value
    assert list(err.failures) == [1]
    assert "deliberate failure on rank one" in err.failures[1]
    assert "Traceback" in err.failures[1] and "_fail_on_rank1" in err.failures[1]
    assert "rank 1 failed:\n" in str(err)
    assert err.hung == []


def test_kills_hanging_rank_within_timeout():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_hang_on_rank1, 2, timeout=8)
    elapsed = time.monotonic() - start
    assert info.value.hung == [1]
    assert info.value.failures == {}
    assert "[1] did not finish" in str(info.value)
    assert elapsed < 8 + 5, f"harness took {elapsed:.1f} s for an 8 s timeout"


def test_failure_stops_the_waiting_peers_early():
    start = time.monotonic()
    with pytest.raises(RanksFailed) as info:
        run_ranks(_fail0_hang1, 2, timeout=120)
    elapsed = time.monotonic() - start
    assert list(info.value.failures) == [0] and info.value.hung == [1]
    assert "rank zero gives up" in str(info.value)
    assert elapsed < 60, f"peers of a failed rank were waited on for {elapsed:.1f} s"


def test_allow_exit_tolerates_sigkill():
    assert run_ranks(_kill_self_on_rank1, 3, timeout=60, allow_exit=(1,)) == [0, None, 20]


def test_unexpected_exit_is_a_failure():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_exit_on_rank0, 2, timeout=60)
    assert list(info.value.failures) == [0]
    assert "exited with code 3" in info.value.failures[0]


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(_identity, 0)
    with pytest.raises(ValueError, match="allow_exit"):
        run_ranks(_identity, 2, allow_exit=(2,))


def _environment(rank, world_size):
    import sys

    import torch

    return os.environ.get("GPUCOMM_TEST_LATE"), torch.get_num_threads(), "gpucomm" in sys.modules


def test_ranks_get_the_callers_environment_of_now(monkeypatch):
    """Ranks forked from the torch-preloaded server see a variable the caller set after the server
    started, and nothing of the caller's own imports."""
    run_ranks(_environment, 1)  # the server is started by now
    monkeypatch.setenv("GPUCOMM_TEST_LATE", "set after the server started")
    late, _, imported = run_ranks(_environment, 1)[0]
    assert late == "set after the server started"
    assert not imported, "a rank inherited gpucomm from the server"


def test_a_thread_count_other_than_the_servers_is_honoured():
    """OpenMP reads OMP_NUM_THREADS once, when torch's import loads it: a rank asked for another
    count than the server's cannot be forked from it and must still get that count."""
    run_ranks(_environment, 1)  # the server is started by now
    wanted = 2 if os.environ.get("OMP_NUM_THREADS") == "1" else 1  # torch takes no more than the cores
    assert [threads for _, threads, _ in run_ranks(_environment, 2, env={"OMP_NUM_THREADS": str(wanted)})] == [
        wanted,
        wanted,
    ]
