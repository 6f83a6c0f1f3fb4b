"""A peer killed in the middle of a loop of collectives on the workspace path is said to be lost
(PeerLostError, crashed), on every surviving rank, within seconds of its death and far inside the
timeout (gpucomm/reliability/lost.py): the host executor's flag waits on shared memory, and an
asynchronous collective's wait on the program kernel (Triton's under the interpreter, CUDA C++'s
built for the host), whose kernel goes on to its own deadline, and the watchdog's look at an
asynchronous collective nobody waits for. The pieces (when a wait looks, whom it names, the
two-look rule, the watchdog's single report) are tested without processes at the end."""

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


# The program kernel's two families on the CPU: Triton's under the interpreter, CUDA C++'s built
# for the host (64 threads a block, as tests/workspace/test_small_allreduce.py runs them: the same
# host build, cached; its first build took 19 s of the case's 23 s on the 2-core VM, then 3.8 s).
FAMILIES = {
    "triton": {"TRITON_INTERPRET": "1"},
    "cuda": {"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64"},
}


@pytest.mark.parametrize("kernels", sorted(FAMILIES))
def test_a_peer_killed_under_the_program_kernel_is_lost_at_an_async_wait(kernels: str) -> None:
    # The kernel's waits are inside it, on the progress thread, and end at its deadline; the
    # caller's wait on the Work looks at the peers' processes meanwhile.
    knobs = {"transport": "shm", "kernels": kernels, "channels": 2}
    results = run_ranks(_killed_in_a_loop, 3, knobs, True, allow_exit=(1,), timeout=300, env=FAMILIES[kernels])
    _check(results, "a collective run by the progress thread")


def _killed_unwaited(rank: int, world_size: int) -> tuple[str, float]:
    """An asynchronous collective nobody waits for: the watchdog tells the loss, and the
    communicator's check (as its next call would) raises it as the cause of CommBrokenError."""
    import os
    import signal

    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=TIMEOUT_S, transport="shm", kernels="triton", channels=2)
    t = torch.ones(1024)
    gpucomm.all_reduce(t)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    gpucomm.all_reduce(t, async_op=True)  # its Work is dropped: only the watchdog looks at it
    while time.monotonic() - start < TIMEOUT_S:
        try:
            gpucomm.check()
        except gpucomm.CommBrokenError as err:
            cause = err.__cause__
            assert isinstance(cause, gpucomm.PeerLostError) and cause.missing == [1] and cause.crashed, repr(cause)
            return str(cause).splitlines()[0], time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError("the watchdog never told the loss")


def test_the_watchdog_tells_a_peer_lost_under_an_async_collective_nobody_waits_for() -> None:
    results = run_ranks(_killed_unwaited, 3, allow_exit=(1,), timeout=90, env={"TRITON_INTERPRET": "1"})
    for rank in (0, 2):
        message, elapsed = results[rank]
        assert elapsed < 10 and f": rank {rank} lost rank(s) [1] " in message, results[rank]
        assert message.endswith("[the watchdog]"), message


# -- the pieces, without processes ----------------------------------------------------------------
class _Liveness:
    """A liveness registry whose ranks in ``dead`` are lost."""

    def __init__(self, dead: set[int]) -> None:
        self.dead = dead

    def hosts(self) -> list[str]:
        return ["here"] * 4

    def lost(self, rank: int) -> bool:
        return rank in self.dead


def test_looks_are_due_from_half_a_second_into_a_wait_then_every_quarter() -> None:
    from gpucomm.reliability.lost import FIRST_LOOK_S, LOOK_EVERY_S, Looks

    looks = Looks()
    assert [looks.due(t) for t in (0.0, 0.1, FIRST_LOOK_S - 0.01)] == [False] * 3
    assert looks.due(FIRST_LOOK_S) and not looks.due(FIRST_LOOK_S + LOOK_EVERY_S / 2)
    assert looks.due(FIRST_LOOK_S + LOOK_EVERY_S)


def test_a_wait_names_the_lost_members_it_waits_for_by_communicator_rank() -> None:
    from gpucomm.errors import PeerLostError
    from gpucomm.reliability.lost import LostPeers

    # a node of communicator ranks [4, 5, 6, 7], this rank 4; rank 6 (local 2) is dead
    lost = LostPeers(_Liveness({6}), [4, 5, 6, 7], 4, 30.0)
    lost.check("broadcast", 3, [1, 3], time.monotonic(), "w")  # not among those waited for: no error
    with pytest.raises(PeerLostError) as caught:
        lost.check("broadcast", 3, [1, 2, 3], time.monotonic() - 0.7, "w")
    err = caught.value
    assert err.missing == [6] and err.crashed and err.rank == 4 and err.epoch == 3 and 0.7 <= err.elapsed < 5
    assert str(err).startswith("gpucomm broadcast call 3: rank 4 lost rank(s) [6] 0.7 s into the call"), str(err)


def test_a_waiter_raises_at_the_second_look_that_finds_a_member_gone() -> None:
    from gpucomm.errors import PeerLostError
    from gpucomm.reliability.lost import LOOK_EVERY_S, LostPeers

    liveness = _Liveness(set())
    lost = LostPeers(liveness, [0, 1, 2], 0, 30.0)
    look = lost.waiter("all_gather", "w", started=time.monotonic() - 10)  # every look is due at once
    look()  # due: nobody gone
    liveness.dead.add(2)
    look()  # not due yet (LOOK_EVERY_S after the last)
    time.sleep(LOOK_EVERY_S)
    look()  # the first look that finds it gone: a peer that signalled and left may still be read
    time.sleep(LOOK_EVERY_S)
    with pytest.raises(PeerLostError, match=r"rank 0 lost rank\(s\) \[2\]"):
        look()


def test_the_watchdog_reports_a_lost_peer_once_and_holds_the_work_until_it_ends() -> None:
    from gpucomm.errors import CommTimeoutError, PeerLostError
    from gpucomm.reliability.lost import FIRST_LOOK_S, LOOK_EVERY_S, LostPeers
    from gpucomm.reliability.watchdog import _Watchdog

    class Work:
        ended, error = False, None

        def is_completed(self) -> bool:
            return self.ended

        def exception(self):
            return self.error

    failures: list[BaseException] = []
    dog, work, queue = _Watchdog(), Work(), object()
    dog.add(work, "all_reduce", 30.0, failures.append, 0, queue, LostPeers(_Liveness({1}), [0, 1], 0, 30.0).waiter)
    deadline = time.monotonic() + FIRST_LOOK_S + 3 * LOOK_EVERY_S + 1
    while not failures and time.monotonic() < deadline:
        dog.poll()
        time.sleep(0.05)
    assert len(failures) == 1 and isinstance(failures[0], PeerLostError) and failures[0].missing == [1], failures
    assert dog.pending() == 1  # still held: its kernel runs to its own deadline
    work.ended, work.error = True, CommTimeoutError("all_reduce", 2, 0, [1], 30.0)
    dog.poll()
    assert dog.pending() == 0 and len(failures) == 1  # the kernel's timeout is not reported again
