"""A hang explains itself: every waiting rank says what the missing ranks are doing, from the
node's flight records (gpucomm/reliability/flight.py, gpucomm/reliability/story.py); ``gpucomm.status()`` and the status
signal show the same on a live job; the errors are torch.distributed's DistBackendError.

On the shared-memory workspace with the torch kernels, and with the Triton program kernel under
the interpreter, where every wait is inside the kernel. Timeouts are short (3 s): the scenarios
wait for them.
"""

from __future__ import annotations

import os
import re
import time

import pytest
from spawn import run_ranks

PATHS = {
    "shm": {"transport": "shm", "kernels": "torch"},
    "triton": {"transport": "shm", "kernels": "triton"},
}
# The interpreter must be on before triton is imported: the harness sets it in each rank.
ENV = {"triton": {"TRITON_INTERPRET": "1"}}
TIMEOUT = 3.0
_FILE = os.path.basename(__file__)


def _site(marker: str, function: str) -> str:
    """``test_hang_story.py:<line> in <function>`` of the line that carries ``# <marker>``."""
    with open(__file__) as f:
        for number, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# {marker}"):
                return f"{_FILE}:{number} in {function}"
    raise LookupError(marker)


def _meet(knobs: dict, **init: object) -> None:
    """Meet the other ranks once under a generous deadline, then part: the short-deadline group
    the scenario builds next starts with every rank there (importing torch, and the interpreter's
    first launch, take seconds on a loaded machine, which would eat a 3 s deadline at init)."""
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=60, **init, **knobs)
    gpucomm.all_reduce(torch.ones(1))
    gpucomm.destroy_process_group()


def _stuck_outside(rank: int, world_size: int, knobs: dict) -> tuple[str, float] | None:
    import torch

    import gpucomm

    _meet(knobs)
    gpucomm.init_process_group(timeout=TIMEOUT, **knobs)
    t = torch.ones(5)
    for _ in range(2):
        gpucomm.all_reduce(t)  # warm-up
    if rank == 2:
        time.sleep(TIMEOUT + 2)  # busy elsewhere: in no collective
        gpucomm.destroy_process_group()
        return None
    start = time.monotonic()
    try:
        gpucomm.all_reduce(t)  # waits for rank 2
    except gpucomm.CommTimeoutError as err:
        elapsed = time.monotonic() - start
        gpucomm.destroy_process_group()
        return str(err), elapsed
    raise AssertionError("the all_reduce returned without rank 2")


@pytest.mark.parametrize("path", sorted(PATHS))
def test_rank_outside_any_collective_is_said_to_be_in_none(path: str) -> None:
    results = run_ranks(_stuck_outside, 3, PATHS[path], timeout=90, env=ENV.get(path))
    warmup, waiting = _site("warm-up", "_stuck_outside"), _site("waits for rank 2", "_stuck_outside")
    for rank in (0, 1):
        text, elapsed = results[rank]
        assert elapsed <= TIMEOUT + 1, f"rank {rank} raised after {elapsed:.1f} s"
        assert f"rank {rank} timed out after 3 s waiting for rank(s) [2]" in text, text
        assert re.search(
            rf"rank 2 is in no collective; it last completed all_reduce #2 \(float32 x 5, op SUM\) of the world group, "
            rf"called at {re.escape(warmup)}, \d+\.\d s ago",
            text,
        ), text
        assert (
            f"rank {rank} (this rank) is in all_reduce #3 (float32 x 5, op SUM) of the world group, called at {waiting}"
            in text
        ), text


def _other_collective(rank: int, world_size: int, knobs: dict) -> str:
    import torch

    import gpucomm

    _meet(knobs)
    gpucomm.init_process_group(timeout=30, **knobs)  # a mismatch is seen at once: no deadline waited for
    t = torch.ones(6)
    gpucomm.all_reduce(t)
    try:
        if rank == 2:
            gpucomm.broadcast(t, src=0)  # the odd one out
        else:
            gpucomm.all_reduce(t)  # what the others call
    except gpucomm.CommMismatchError as err:
        gpucomm.destroy_process_group()
        return str(err)
    raise AssertionError("mismatched calls went through")


@pytest.mark.parametrize("path", sorted(PATHS))
def test_mismatch_shows_both_calls_side_by_side(path: str) -> None:
    results = run_ranks(_other_collective, 3, PATHS[path], timeout=90, env=ENV.get(path))
    odd, usual = _site("the odd one out", "_other_collective"), _site("what the others call", "_other_collective")
    for rank, text in enumerate(results):
        assert "the calls diverged at call #2 of the world group:" in text, text
        rows = {line.split()[1]: line for line in text.splitlines() if re.match(r"\s+rank \d ", line)}
        header = next(line for line in text.splitlines() if "collective" in line and "call site" in line)
        assert header.split() == ["collective", "dtype", "count", "op", "root", "call", "site"], text
        peer = next(int(r) for r in rows if int(r) != rank)
        assert rank != 2 or peer in (0, 1), text
        assert rank == 2 or peer == 2, text
        for r in (rank, peer):
            cells = rows[str(r)].split(None, 2)[2]
            if r == 2:
                assert re.match(rf"broadcast\s+float32\s+6\s+-\s+0\s+{re.escape(odd)}$", cells), text
            else:
                assert re.match(rf"all_reduce\s+float32\s+6\s+SUM\s+-\s+{re.escape(usual)}$", cells), text


def _subgroup_barrier(rank: int, world_size: int, knobs: dict) -> str:
    import torch

    import gpucomm

    _meet(knobs)
    gpucomm.init_process_group(timeout=TIMEOUT, **knobs)
    # The pair waits longer than the world, so that rank 3 is still in its barrier when 0-2 raise.
    pair = gpucomm.new_group([2, 3], timeout=TIMEOUT + 3)
    t = torch.ones(3)
    gpucomm.all_reduce(t)
    try:
        if rank == 3:
            gpucomm.barrier(group=pair)  # rank 3 waits for rank 2 in the subgroup
        else:
            time.sleep(1)  # rank 3 is in its barrier before the world's deadline starts to run
            gpucomm.all_reduce(t)  # ranks 0-2 wait for rank 3 in the world
    except gpucomm.CommTimeoutError as err:
        gpucomm.destroy_process_group()
        return str(err)
    raise AssertionError("the calls went through")


@pytest.mark.parametrize("path", sorted(PATHS))
def test_rank_waiting_in_a_subgroup_is_said_to_be_there(path: str) -> None:
    results = run_ranks(_subgroup_barrier, 4, PATHS[path], timeout=120, env=ENV.get(path))
    barrier, world = (
        _site("rank 3 waits for rank 2 in the subgroup", "_subgroup_barrier"),
        _site("ranks 0-2 wait for rank 3 in the world", "_subgroup_barrier"),
    )
    for rank in (0, 1, 2):
        text = results[rank]
        assert f"rank {rank} timed out after 3 s waiting for rank(s) [3]" in text, text
        assert f"rank 3 is in barrier #1 of group [2, 3], called at {barrier}, for " in text, text
        assert (
            f"rank {rank} (this rank) is in all_reduce #2 (float32 x 3, op SUM) of the world group, called at {world}"
            in text
        ), text
    text = results[3]  # in the pair, global rank 2 is rank 0; it gave up on the world's all_reduce 2 s ago
    assert "rank 1 timed out after 6 s waiting for rank(s) [0]" in text, text
    assert (
        "rank 0 (global rank 2) is in no collective (its all_reduce #2 (float32 x 3, op SUM) of the world group, "
        f"called at {world} failed " in text
    ), text
    assert f"rank 1 (this rank) is in barrier #1 of group [2, 3], called at {barrier}" in text, text


def _live_job(rank: int, world_size: int, knobs: dict) -> str:
    import io
    import signal
    import sys

    import torch

    import gpucomm

    _meet(knobs)
    gpucomm.init_process_group(timeout=30, status_signal="SIGUSR1", **knobs)
    t = torch.ones(2)
    gpucomm.all_reduce(t)
    if rank != 2:
        sys.stderr = captured = io.StringIO()  # the signal's table lands here
        gpucomm.all_reduce(t)  # ranks 0 and 1 wait here
        sys.stderr = sys.__stderr__
        gpucomm.destroy_process_group()
        return captured.getvalue()
    time.sleep(1.5)
    table = str(gpucomm.status())
    pids = {r.rank: r.pid for r in gpucomm.status().ranks}
    os.kill(pids[0], signal.SIGUSR1)
    time.sleep(1.0)
    gpucomm.all_reduce(t)  # rank 2 arrives late
    gpucomm.destroy_process_group()
    return table


def _rows(table: str) -> dict[int, dict[str, str]]:
    """The status table, parsed: rank -> column -> cell (columns apart by 2+ spaces)."""
    lines = table.strip().splitlines()
    assert lines[0].startswith("gpucomm status of the node of rank"), table
    header = re.split(r"\s{2,}", lines[1].strip())
    assert header == ["rank", "pid", "in now", "for", "last completed", "ago"], table
    rows = {}
    for line in lines[2:]:
        cells = re.split(r"\s{2,}", line.strip())
        rows[int(cells[0])] = dict(zip(header, cells))
    return rows


@pytest.mark.parametrize("path", sorted(PATHS))
def test_status_and_the_signal_show_who_waits(path: str) -> None:
    results = run_ranks(_live_job, 3, PATHS[path], timeout=120, env=ENV.get(path))
    waiting = _site("ranks 0 and 1 wait here", "_live_job")
    # gpucomm.status() on rank 2, and the table rank 0 printed on SIGUSR1 while it waited.
    for table in (results[2], results[0]):
        rows = _rows(table)
        assert sorted(rows) == [0, 1, 2], table
        for r in (0, 1):
            assert rows[r]["in now"] == f"all_reduce #2 world at {waiting}", table
            assert re.fullmatch(r"\d+\.\d s", rows[r]["for"]), table
        assert rows[2]["in now"] == "-" and rows[2]["for"] == "-", table
        assert rows[2]["last completed"].startswith("all_reduce #1 world at "), table
    assert results[1] == "", "only the signalled rank prints"


def _torch_types(rank: int, world_size: int, entry: str, tmp: str) -> list[str]:
    import datetime

    import torch
    import torch.distributed as tdist

    import gpucomm

    dist = tdist if entry == "torch" else gpucomm
    caught = []
    t = torch.ones(4)

    def init(name: str) -> None:
        if entry == "torch":
            tdist.init_process_group(
                "gpucomm",
                init_method=f"file://{tmp}/{name}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=TIMEOUT),
            )
        else:
            gpucomm.init_process_group(
                init_method=f"file://{tmp}/{name}", rank=rank, world_size=world_size, timeout=TIMEOUT
            )

    _meet({}, init_method=f"file://{tmp}/meet", rank=rank, world_size=world_size)
    init("timeout")
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(TIMEOUT + 2)
    else:
        for error in (gpucomm.CommTimeoutError, gpucomm.CommBrokenError):
            try:
                dist.all_reduce(t)
            except tdist.DistBackendError as err:
                assert isinstance(err, error), repr(err)
                caught.append(type(err).__name__)
    dist.destroy_process_group()
    init("mismatch")
    try:
        if rank == 1:
            dist.broadcast(t, src=0)
        else:
            dist.all_reduce(t)
    except tdist.DistBackendError as err:
        assert isinstance(err, gpucomm.CommMismatchError), repr(err)
        caught.append(type(err).__name__)
    dist.destroy_process_group()
    return caught


@pytest.mark.parametrize("entry", ["torch", "gpucomm"])
def test_errors_are_torch_dist_backend_errors(entry: str, tmp_path) -> None:
    results = run_ranks(_torch_types, 2, entry, str(tmp_path), timeout=90)
    assert results == [["CommTimeoutError", "CommBrokenError", "CommMismatchError"], ["CommMismatchError"]]


def test_status_signal_knob_is_off_by_default_and_checked() -> None:
    from gpucomm.config import Config

    assert Config.from_env({}).status_signal == ""
    assert Config.from_env({"GPUCOMM_STATUS_SIGNAL": "usr1"}).status_signal == "SIGUSR1"
    assert Config.from_env({}, status_signal="SIGUSR2").status_signal == "SIGUSR2"
    assert Config.from_env({"GPUCOMM_STATUS_SIGNAL": "off"}).status_signal == ""
    with pytest.raises(ValueError, match="GPUCOMM_STATUS_SIGNAL must be off, SIGUSR1 or SIGUSR2, got 'SIGKILL'"):
        Config.from_env({"GPUCOMM_STATUS_SIGNAL": "SIGKILL"})
