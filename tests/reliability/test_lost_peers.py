"""A peer killed in the middle of a loop of collectives on the workspace path is said to be lost
(PeerLostError, crashed), on every surviving rank, within seconds of its death and far inside the
timeout (gpucomm/reliability/lost.py): the host executor's flag waits on shared memory, and an
asynchronous collective's wait on the Triton program kernel under the interpreter, whose kernel
goes on to its own deadline."""

from __future__ import annotations

import time

import pytest
from spawn import run_ranks

# Far longer than the loss takes to be told: an error that waited for it fails the tests.
TIMEOUT_S = 30.0


def _killed_in_a_loop(rank: int, world_size: int, knobs: dict, async_op: bool) -> tuple[str, float, bool, list]:
    import os
    import signal

    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=TIMEOUT_S, **knobs)
    t = torch.ones(1024)
    gpucomm.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        for _ in range(100000):
            work = gpucomm.all_reduce(t, async_op=async_op)
            if async_op:
                work.wait()
    except gpucomm.PeerLostError as err:
        elapsed = time.monotonic() - start
        with pytest.raises(gpucomm.CommBrokenError):
            gpucomm.all_reduce(t)
        return str(err).splitlines()[0], elapsed, err.crashed, err.missing
    raise AssertionError("the collectives went on with a dead peer")


def _check(results: list, detail: str) -> None:
    for rank in (0, 2):
        message, elapsed, crashed, missing = results[rank]
        assert crashed and missing == [1], results[rank]
        assert elapsed < 10, f"rank {rank} took {elapsed:.1f} s to tell the loss"
        assert f": rank {rank} lost rank(s) [1] " in message, message
        assert "s into the call: its process is gone (it crashed, was killed or exited); not a slow rank" in message
        assert f"[{detail}]" in message and "timed out" not in message, message
        # the time it names is how long into the call it was seen, under the 30 s timeout
        said = float(message.split(" lost rank(s) [1] ")[1].split(" s into")[0])
        assert 0.4 <= said < 10, message


def test_a_peer_killed_on_the_shm_workspace_is_lost_within_seconds_not_a_timeout() -> None:
    knobs = {"transport": "shm", "kernels": "torch"}
    results = run_ranks(_killed_in_a_loop, 3, knobs, False, allow_exit=(1,), timeout=90)
    _check(results, "the workspace's flag wait")


def test_a_peer_killed_under_the_triton_program_kernel_is_lost_at_an_async_wait() -> None:
    # The kernel's waits are inside it, on the progress thread, and end at its deadline; the
    # caller's wait on the Work looks at the peers' processes meanwhile.
    knobs = {"transport": "shm", "kernels": "triton", "channels": 2}
    results = run_ranks(_killed_in_a_loop, 3, knobs, True, allow_exit=(1,), timeout=90, env={"TRITON_INTERPRET": "1"})
    _check(results, "a collective run by the progress thread")
