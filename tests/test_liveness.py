"""Naming the dead rank after a gloo failure (gpucomm.liveness), with the store gone too."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import torch.distributed as dist

from gpucomm.liveness import Liveness, alive


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
        store.set("t/live/proc/0", f"{mine.host} {os.getpid()}")  # rank 0: alive, but its store goes
        store.set("t/live/proc/1", f"{mine.host} {victim.pid}")
        assert mine.one_host()
        os.kill(victim.pid, signal.SIGKILL)
        time.sleep(0.2)
        store.gone = True
        assert mine.culprits(seq=7, grace=0.1) == [1]
    finally:
        victim.wait()
