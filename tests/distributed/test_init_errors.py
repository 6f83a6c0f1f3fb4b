"""What a user meets in the first hour, said in words: knobs that differ between ranks, a rank
that never joined, a peer that crashed (not a slow one), a store without ``rank=``, the start-up
summary of ``GPUCOMM_DEBUG=INFO`` and what ``DEBUG`` adds, and the backend string.

Every multi-rank case runs with a timeout of a few seconds, so that the file stays quick."""

from __future__ import annotations

import logging
import time

import pytest
from checks import outcome as _outcome
from spawn import run_ranks


class _Lines(logging.Handler):
    """gpucomm's log records of this rank, kept in a list."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _caught() -> _Lines:
    handler = _Lines()
    logging.getLogger("gpucomm").addHandler(handler)
    return handler


# -- knobs agreed --------------------------------------------------------------------------
def _transport_differs(rank: int, world_size: int) -> str:
    import gpucomm

    transport = "gloo" if rank == 1 else "auto"
    return _outcome(lambda: gpucomm.init_process_group(transport=transport, timeout=5, workspace_bytes=1 << 20))


def test_a_knob_mismatch_is_a_typed_error_on_every_rank_naming_each_ranks_value() -> None:
    results = run_ranks(_transport_differs, 3, timeout=60)
    expected = (
        "KnobMismatchError: gpucomm.init_process_group: the ranks disagree on knobs that must be the same on every "
        "rank: transport: 'auto' on rank(s) [0, 2], 'gloo' on rank(s) [1]. Set GPUCOMM_TRANSPORT (or the keywords "
        "of init_process_group) alike on every rank"
    )
    assert results == [expected] * 3, results


def _timeout_differs(rank: int, world_size: int) -> tuple[str, list[int], bool]:
    import gpucomm

    try:
        gpucomm.init_process_group(backend="gloo", timeout=5 + rank)
    except gpucomm.KnobMismatchError as err:
        return str(err), err.peers, isinstance(err, gpucomm.CommMismatchError)
    return "ok", [], False


def test_a_timeout_that_differs_names_both_values_and_the_other_rank() -> None:
    results = run_ranks(_timeout_differs, 2, timeout=60)
    for rank, (message, peers, typed) in enumerate(results):
        assert "timeout: 5.0 on rank(s) [0], 6.0 on rank(s) [1]" in message, message
        assert peers == [1 - rank] and typed, results


# -- a rank that never joined ---------------------------------------------------------------
def _two_of_three(rank: int, world_size: int) -> str:
    import gpucomm

    return _outcome(lambda: gpucomm.init_process_group(backend="gloo", timeout=2))


def test_a_rank_that_never_joined_is_named_on_every_waiting_rank() -> None:
    # Two processes of a world of three: rank 2 is never started.
    results = run_ranks(_two_of_three, 2, env={"WORLD_SIZE": "3"}, timeout=60)
    expected = (
        "NeverJoinedError: gpucomm.init_process_group: rank 2 never joined (2 of 3 arrived after 2 s); start every "
        "rank, or check WORLD_SIZE and each rank's RANK"
    )
    assert results == [expected] * 2, results


def test_never_joined_is_a_dist_backend_error_and_a_timeout() -> None:
    import torch.distributed as dist

    from gpucomm.errors import CommTimeoutError, NeverJoinedError

    err = NeverJoinedError("init_process_group", 0, [2, 3], 4, 2.0)
    assert isinstance(err, dist.DistBackendError) and isinstance(err, CommTimeoutError)
    assert str(err).startswith("gpucomm.init_process_group: ranks 2, 3 never joined (2 of 4 arrived after 2 s)")
    assert err.missing == [2, 3] and err.arrived == 2


# -- a peer that crashed ----------------------------------------------------------------------
def _crashed_peer(rank: int, world_size: int) -> tuple[str, float, bool] | None:
    import os
    import signal

    import torch

    import gpucomm

    timeout = 30.0  # far longer than the loss takes to be told: the error must not wait for it
    gpucomm.init_process_group(backend="gloo", timeout=timeout)
    t = torch.ones(1024)
    gpucomm.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(100000):
            gpucomm.all_reduce(t)
    except gpucomm.PeerLostError as err:
        return str(err).splitlines()[0], time.monotonic() - start, err.crashed and err.missing == [1]
    raise AssertionError("the collectives went on with a dead peer")


def test_a_crashed_peer_is_said_to_be_gone_with_how_long_it_took_not_a_timeout() -> None:
    results = run_ranks(_crashed_peer, 3, allow_exit=(1,), timeout=90)
    for rank in (0, 2):
        message, elapsed, crashed = results[rank]
        assert crashed and elapsed < 15, results[rank]
        assert f": rank {rank} lost rank(s) [1] " in message, message
        assert "s into the call: its process is gone (it crashed, was killed or exited); not a slow rank" in message
        assert "timed out" not in message, message
        # the time it names is the time it took, to a tenth of a second (and under the 30 s timeout)
        said = float(message.split(" lost rank(s) [1] ")[1].split(" s into")[0])
        assert said < 15, message


# -- a store without rank= --------------------------------------------------------------------
def test_a_store_without_rank_asks_for_rank_and_world_size() -> None:
    import torch.distributed as dist

    import gpucomm

    with pytest.raises(ValueError) as caught:
        gpucomm.init_process_group(store=dist.HashStore(), world_size=1)
    assert str(caught.value) == (
        "gpucomm.init_process_group: store= was passed without rank=: pass rank= and world_size= with store= "
        "(a store does not say which rank this process is)"
    )
    with pytest.raises(ValueError, match="without rank= and world_size=: pass rank= and world_size= with store="):
        gpucomm.init_process_group(store=dist.HashStore())
    assert not gpucomm.is_initialized()


# -- the start-up summary and DEBUG ----------------------------------------------------------
def _summary(rank: int, world_size: int, level: str) -> list[str]:
    import torch

    import gpucomm

    lines = _caught()
    gpucomm.init_process_group(transport="shm", debug=level, timeout=20)
    gpucomm.all_reduce(torch.ones(8))
    gpucomm.destroy_process_group()
    return lines.lines


def test_info_prints_one_summary_on_rank_0_and_debug_adds_each_calls_stages() -> None:
    info = run_ranks(_summary, 2, "INFO", timeout=60)
    head = [line for line in info[0] if line.startswith("gpucomm INFO [rank 0] ")]
    assert [line.split("] ")[1].split(" ")[0] for line in head] == ["gpucomm", "world:", "cpu", "knobs"], head
    assert "world: 2 ranks, 2 per node, on 1 host(s): " in head[1] and head[1].endswith(" ranks 0-1"), head
    assert "cpu tensors: workspace transport=shm kernels=torch channels=" in head[2], head
    assert "all_reduce 4K=oneshot" in head[2], head
    assert head[3].endswith("knobs set: GPUCOMM_TRANSPORT=shm GPUCOMM_TIMEOUT=20.0 GPUCOMM_DEBUG=INFO"), head
    assert not any("INFO" in line for line in info[1]), info[1]  # rank 0 only
    assert not any(line.startswith("gpucomm DEBUG") for lines in info for line in lines), info
    assert any("all_reduce bytes=32" in line and "path=workspace" in line for line in info[1]), info[1]

    debug = run_ranks(_summary, 2, "DEBUG", timeout=60)
    for rank, lines in enumerate(debug):
        stages = [line for line in lines if line.startswith(f"gpucomm DEBUG [rank {rank}] all_reduce call 1: ")]
        assert len(stages) == 2, lines
        assert "blocking, workspace program oneshot, runs on the calling thread" in stages[0], stages
        assert " returned after " in stages[1], stages


# -- the backend string ----------------------------------------------------------------------
def _backends(rank: int, world_size: int) -> dict:
    import torch.distributed as tdist

    import gpucomm

    out = {}
    for backend in ("nccl", None, "gloo"):
        lines = _caught()
        gpucomm.init_process_group(backend, timeout=20)
        out[str(backend)] = (gpucomm.get_backend(), tdist.get_backend(), [x for x in lines.lines if "gloo" in x])
        logging.getLogger("gpucomm").removeHandler(lines)
        gpucomm.destroy_process_group()
    return out


def test_get_backend_returns_the_string_passed_and_gloo_says_so_at_init() -> None:
    results = run_ranks(_backends, 2, timeout=90)
    for rank, out in enumerate(results):
        assert out["nccl"][:2] == ("nccl", "gpucomm") and out["None"][:2] == ("gpucomm", "gpucomm"), out
        assert out["gloo"][:2] == ("gloo", "gpucomm"), out
        assert out["nccl"][2] == out["None"][2] == [], out
        said = out["gloo"][2]
        if rank == 0:
            assert len(said) == 1 and "every call goes through gloo (path=gloo)" in said[0], said
            assert "pass backend=None, 'gpucomm' or 'nccl' for gpucomm's own paths" in said[0], said
        else:
            assert said == [], said


def test_rank_0_that_never_served_the_store_is_named_not_a_socket() -> None:
    from spawn import free_port

    import gpucomm

    port = free_port()  # nobody serves it: rank 0 was never started
    start = time.monotonic()
    with pytest.raises(gpucomm.NeverJoinedError) as caught:
        gpucomm.init_process_group(init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=2)
    assert str(caught.value) == (
        f"gpucomm.init_process_group: rank 0 never joined (no store at 127.0.0.1:{port}, which rank 0 serves, after "
        "2 s); start rank 0, or check MASTER_ADDR and MASTER_PORT (or the tcp:// address)"
    )
    assert caught.value.missing == [0] and caught.value.arrived is None
    assert time.monotonic() - start < 60 and not gpucomm.is_initialized()
