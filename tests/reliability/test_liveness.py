"""Naming the dead rank after a gloo failure (gpucomm.reliability.liveness), with the store gone too."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import torch.distributed as dist

from gpucomm.reliability.liveness import Liveness
from gpucomm.transport.processes import alive


def test_a_killed_process_is_dead_before_it_is_reaped():
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while alive(child.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive(child.pid)  # a zombie until wait() below: signal 0 still reaches it
        os.kill(child.pid, 0)
    finally:
        child.wait()
    assert not alive(child.pid)


class _GoneStore(dist.HashStore):
    """A store that fails every request once ``gone`` is set, as when rank 0, its server, exits."""

    gone = False

    def _check(self) -> None:
        if self.gone:
            raise RuntimeError("Connection reset by peer")

    def get(self, key):  # noqa: ANN001, ANN201 - dist.Store's signature
        self._check()
        return super().get(key)

    def set(self, key, value):  # noqa: ANN001, ANN201
        self._check()
        return super().set(key, value)

    def wait(self, keys, *timeout):  # noqa: ANN001, ANN201
        self._check()
        return super().wait(keys, *timeout)

    def check(self, keys):  # noqa: ANN001, ANN201
        self._check()
        return super().check(keys)


def test_the_dead_rank_is_named_when_the_store_has_gone_with_rank_0():
    victim = subprocess.Popen(["sleep", "30"])
    store = _GoneStore()
    try:
        mine = Liveness(store, "t/", 2, 3)
        store.set("t/live/proc/0", f"{mine.host} {os.getpid()} {mine.pid_space}")  # rank 0: alive, but its store goes
        store.set("t/live/proc/1", f"{mine.host} {victim.pid} {mine.pid_space}")
        assert mine.one_host()
        os.kill(victim.pid, signal.SIGKILL)
        time.sleep(0.2)
        store.gone = True
        assert mine.culprits(seq=7, grace=0.1) == [1]
    finally:
        victim.wait()


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_killed_rank_is_named_not_the_rank_that_left_after_failing():
    """The race of the flaky gloo test: rank 0 failed its call (the peer's death), stamped it,
    and exited, taking the store with it, before rank 2 looked; rank 1 was killed. Rank 2 must
    name rank 1 alone. Before, it named rank 0 (the store was gone) or every dead rank."""
    killed = subprocess.Popen(["sleep", "30"])
    store = _GoneStore()
    try:
        mine = Liveness(store, "t/", 2, 3)
        store.set("t/live/proc/0", f"{mine.host} {_dead_pid()} {mine.pid_space}")
        store.set("t/live/proc/1", f"{mine.host} {killed.pid} {mine.pid_space}")
        assert mine.one_host()
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        store.gone = True
        assert mine.culprits(seq=7, grace=0.5, failed_first=lambda r: r == 0) == [1]
        # Without the flight record's word, both look killed: both are named.
        assert mine.culprits(seq=7, grace=0.5) == [0, 1]
    finally:
        killed.kill()
        killed.wait()


def test_a_rank_killed_during_the_grace_is_named_at_once():
    """Rank 2's gloo call failed while rank 1 was still dying (sockets closed, not yet a zombie):
    rank 0 checks in, and rank 1 is named as soon as its process is gone, not at the grace's end."""
    dying = subprocess.Popen(["sleep", "30"])
    store = dist.HashStore()
    try:
        mine = Liveness(store, "t/", 2, 3)
        store.set("t/live/proc/0", f"{mine.host} {os.getpid()} {mine.pid_space}")
        store.set("t/live/proc/1", f"{mine.host} {dying.pid} {mine.pid_space}")
        assert mine.one_host()
        store.set("t/live/seq3/0", b"1")  # rank 0: alive, failing the same call
        threading.Timer(0.3, os.kill, (dying.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        assert mine.culprits(seq=3, grace=10.0, failed_first=lambda r: False) == [1]
        assert time.monotonic() - start < 3.0
    finally:
        dying.kill()
        dying.wait()


def test_a_pid_from_another_pid_namespace_is_not_judged():
    """Containers on one machine may share a host name but not their pids: a peer's pid is looked
    up only where it means the same process. Here rank 1's pid is dead in this namespace, but it
    published another: it is named only because it never checks in."""
    store = dist.HashStore()
    mine = Liveness(store, "t/", 0, 2)
    store.set("t/live/proc/1", f"{mine.host} {_dead_pid()} other-boot/4026531836")
    assert mine.one_host()
    start = time.monotonic()
    assert mine.culprits(seq=1, grace=0.5, failed_first=lambda r: False) == [1]
    assert time.monotonic() - start >= 0.5  # found by the grace, not by its pid
