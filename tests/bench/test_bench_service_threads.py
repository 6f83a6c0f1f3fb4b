"""A bound rank keeps its own thread on its core and lets the threads its backends start (gloo's
I/O) run on every core the bench was given (bench/service_threads.py)."""

from __future__ import annotations

import os
import threading

import pytest

from gpucomm._bench import service_threads


@pytest.fixture
def one_core():
    """This thread bound to one core, as a spawned rank is; restored afterwards."""
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        pytest.skip("needs 2 cores: a rank's one core and another for its backends' threads")
    service_threads.spread_over(cores)
    os.sched_setaffinity(0, {min(cores)})
    try:
        yield cores
    finally:
        os.sched_setaffinity(0, cores)
        service_threads.spread_over(None)


def _start_waiting_thread(stop: threading.Event) -> tuple[threading.Thread, list[int]]:
    ident: list[int] = []
    started = threading.Event()

    def body() -> None:
        ident.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    thread = threading.Thread(target=body, name="backend-io")
    thread.start()
    started.wait(30)
    return thread, ident


def test_threads_started_after_the_snapshot_run_on_every_core_and_the_rank_stays_bound(one_core):
    stop = threading.Event()
    early, early_id = _start_waiting_thread(stop)  # there before the backends start: left alone
    before = service_threads.thread_ids()
    late, late_id = _start_waiting_thread(stop)  # a backend's own thread
    try:
        assert os.sched_getaffinity(late_id[0]) == {min(one_core)}  # it started on the rank's core
        assert len(service_threads.release(before)) == 1  # its OS name (Python's threads: "python")
        assert os.sched_getaffinity(late_id[0]) == one_core
        assert os.sched_getaffinity(early_id[0]) == {min(one_core)}
        assert os.sched_getaffinity(0) == {min(one_core)}
    finally:
        stop.set()
        early.join()
        late.join()


def test_nothing_moves_where_no_cores_were_given():
    service_threads.spread_over(None)
    stop = threading.Event()
    before = service_threads.thread_ids()
    late, _ = _start_waiting_thread(stop)
    try:
        assert service_threads.release(before) == []
    finally:
        stop.set()
        late.join()


def test_an_empty_core_set_is_refused_by_name():
    with pytest.raises(ValueError, match=r"spread_over: expected a non-empty set of cores or None, got set\(\)"):
        service_threads.spread_over(set())
