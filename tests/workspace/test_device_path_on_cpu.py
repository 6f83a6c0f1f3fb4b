"""First contact with a GPU: what a reading of the GPU path predicted would break, shown on CPU.

Each test here failed on the code of 2026-11-22 (the commit before it was fixed) and passes now;
docs/architecture.md ("First contact") lists the predictions, the fixes and what only a GPU can
confirm. The GPU halves are in tests/gpu/test_first_contact_gpu.py.
"""

from __future__ import annotations

import sys

from spawn import run_ranks


# -- 1. the program cache keeps addresses, never the caller's tensors ---------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _fresh_tensors_each_call(rank: int, world_size: int, calls: int, numel: int) -> tuple[int, int]:
    import torch

    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels="torch", algo="oneshot")
    # Warm up: the workspace, torch's allocator and the first program are paid for here.
    for _ in range(3):
        gpucomm.all_reduce(torch.ones(numel))
    before = _rss_bytes()
    midway = 0
    for step in range(calls):
        if step == 100:
            midway = _rss_bytes()
        t = torch.full((numel,), float(rank + step))
        gpucomm.all_reduce(t)
        if step == 0 and t[0].item() != sum(r + step for r in range(world_size)):
            raise AssertionError(f"all_reduce gave {t[0].item()}")
        del t
    after = _rss_bytes()
    gpucomm.destroy_process_group()
    return after - before, after - midway


def test_program_cache_does_not_keep_callers_tensors():
    """350 all_reduce calls on fresh 4 MiB tensors: the rank's resident set grows by a few MiB,
    not by the 256 tensors the cache used to hold through views of them (1.4 GiB measured on
    the code of 2026-11-22; 24 MiB now, all of it in the first 50 calls), and not at all after
    the first hundred."""
    numel = (4 << 20) // 4
    for grown, late in run_ranks(_fresh_tensors_each_call, 2, 350, numel, timeout=240):
        assert grown < 48 << 20, f"the resident set grew by {grown / 2**20:.0f} MiB over 350 calls"
        assert late < 8 << 20, f"the resident set grew by {late / 2**20:.0f} MiB over the last 250 calls"


def _aliases_survive_a_new_tensor_at_the_same_address(rank: int, world_size: int) -> list[float]:
    """A cached program names buffers by address: a new tensor at an old address must be read
    and written, not a stale copy."""
    import torch

    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels="torch", algo="oneshot")
    results = []
    for step in range(4):
        t = torch.full((1000,), float(rank * 10 + step))
        gpucomm.all_reduce(t)
        results.append(float(t[999]))
        del t  # the allocator hands the same block to the next tensor, often
    gpucomm.destroy_process_group()
    return results


def test_cached_program_serves_a_new_tensor_at_an_old_address():
    for results in run_ranks(_aliases_survive_a_new_tensor_at_the_same_address, 2):
        assert results == [10.0 + 2 * step for step in range(4)]


# -- 2. the watchdog's poll does not grow with the works in flight ------------------------------
class _PendingWork:
    """A Work that has not ended; counts how often it is asked."""

    asked = 0

    def is_completed(self) -> bool:
        _PendingWork.asked += 1
        return False

    def exception(self) -> None:
        return None


def test_watchdog_poll_asks_only_the_oldest_work_of_each_queue():
    """10,000 works in flight on one stream and 10 on another: a poll asks two works whether they
    ended (stream order: none after an unfinished one has), not 10,010; the poll used to compare
    every pending work with every ended one."""
    from gpucomm.reliability.watchdog import _Watchdog

    dog = _Watchdog()
    stream_a, stream_b = object(), object()
    for _ in range(10_000):
        dog.add(_PendingWork(), "all_reduce", 60.0, lambda err: None, 0, stream_a)
    for _ in range(10):
        dog.add(_PendingWork(), "all_reduce", 60.0, lambda err: None, 0, stream_b)
    _PendingWork.asked = 0
    dog.poll()
    assert _PendingWork.asked == 2
    assert dog.pending() == 10_010


def test_watchdog_drops_ended_works_in_order_and_reports_their_errors():
    from gpucomm.reliability.watchdog import _Watchdog

    class Ended(_PendingWork):
        def __init__(self, error=None):
            self.error = error

        def is_completed(self) -> bool:
            return True

        def exception(self):
            return self.error

    failures: list[BaseException] = []
    dog = _Watchdog()
    queue = object()
    boom = RuntimeError("kernel record")
    for work in (Ended(), Ended(boom), _PendingWork(), Ended()):
        dog.add(work, "broadcast", 60.0, failures.append, 0, queue)
    dog.poll()
    assert failures == [boom]
    assert dog.pending() == 2  # the unfinished work and the one behind it


# -- 3. the watchdog never invalidates another thread's CUDA graph capture ----------------------
def test_watchdog_queries_events_in_thread_local_capture_mode(monkeypatch):
    """CUDA's rules, faked: while a thread captures in global mode, an event query from a thread
    whose capture mode is global invalidates the capture; from a thread in thread-local mode it
    does not. The watchdog's thread queries the works it watches during such a capture."""
    import threading
    import time

    import gpucomm.capture as capture
    from gpucomm.reliability.watchdog import _Watchdog

    modes = threading.local()  # the driver's per-thread capture mode; global by default
    state = {"capturing": True, "invalidated": False, "queries": 0}

    def exchange_mode(mode: int) -> int:
        previous = getattr(modes, "mode", capture.CAPTURE_MODE_GLOBAL)
        modes.mode = mode
        return previous

    class EventWork(_PendingWork):
        def is_completed(self) -> bool:
            state["queries"] += 1
            if (
                state["capturing"]
                and getattr(modes, "mode", capture.CAPTURE_MODE_GLOBAL) == capture.CAPTURE_MODE_GLOBAL
            ):
                state["invalidated"] = True
            return not state["capturing"]

    monkeypatch.setattr(capture, "_exchange_mode", exchange_mode)
    dog = _Watchdog()
    dog.watch(EventWork(), "all_reduce", 60.0, lambda err: None, 0, object())
    deadline = time.monotonic() + 10
    while state["queries"] < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    state["capturing"] = False
    assert state["queries"] >= 3, "the watchdog never polled"
    assert not state["invalidated"], "the watchdog queried an event in global capture mode during a capture"


# -- 8. the benchmark runs without tqdm -----------------------------------------------------------
def test_bench_runs_without_tqdm(tmp_path):
    """A GPU machine installs gpucomm with --no-deps and has no network: the benchmark must run
    without tqdm, bar or no bar. Every process of the run (the CLI, its spawned ranks) finds a
    tqdm that cannot be imported first on its path."""
    import os
    import subprocess

    (tmp_path / "tqdm.py").write_text("raise ImportError('tqdm is not installed here')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUCOMM_") and k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    args = ["all_reduce", "--backend", "gloo", "--nproc", "2", "-b", "8", "-e", "64", "-f", "8", "-n", "1", "-w", "0"]
    proc = subprocess.run(
        [sys.executable, "-m", "gpucomm._bench.cli", *args], capture_output=True, text=True, timeout=150, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tqdm" not in proc.stderr
    assert "64" in proc.stdout  # the table's last row


# -- 7. barrier waits on the host -----------------------------------------------------------------
def test_barrier_waits_on_the_host(monkeypatch):
    """On a GPU the barrier's kernel is queued on a stream; the call must still return only once
    every rank has arrived, so its Work waits on the host (``blocking``), as a barrier does on
    NCCL. Shown with the path's Work faked: it records how it was waited for."""
    from gpucomm.comm.communicator import Communicator

    waits: list[bool] = []

    class QueuedWork:
        blocking = False

        def wait(self) -> bool:
            waits.append(self.blocking)
            return True

    comm = Communicator.__new__(Communicator)
    comm._closed, comm._broken = False, None
    monkeypatch.setattr(Communicator, "_run", lambda self, fn, tensor, async_op, serve, *rest, **kw: QueuedWork())
    assert comm.barrier() is None
    assert waits == [True]
    work = comm.barrier(async_op=True)
    assert work.blocking is True


# -- 6. CUDA graphs in real use (the capture state faked on CPU) ----------------------------------
INTERPRET = {"TRITON_INTERPRET": "1"}
TRITON = {"transport": "shm", "kernels": "triton", "workspace_bytes": "64K", "timeout": 30}


def _capture_before_warm_up(rank: int, world_size: int) -> list[str]:
    import torch

    import gpucomm
    import gpucomm.workspace.device_executor as device_executor
    from gpucomm.errors import UnsupportedError

    gpucomm.init_process_group(**TRITON)
    t = torch.full((100,), float(rank + 1))
    seen = []
    device_executor.capturing = lambda device: True  # as if the caller were capturing a graph
    try:
        gpucomm.all_reduce(t)
    except UnsupportedError as err:
        seen.append(str(err))
    device_executor.capturing = lambda device: False
    gpucomm.all_reduce(t)  # the warm-up: tables go to the device now
    device_executor.capturing = lambda device: True
    t.fill_(rank + 1)
    gpucomm.all_reduce(t)  # captured now: no table to copy
    seen.append(str(t[0].item()))
    gpucomm.destroy_process_group()
    return seen


def test_capturing_a_shape_that_never_ran_eagerly_says_what_to_do():
    """Capturing a call shape that never ran copies its tables host-to-device inside the capture,
    which a replay would repeat from memory that is gone: a clear error instead, naming the
    collective and the warm-up to run; after the warm-up the same call captures."""
    for rank_seen in run_ranks(_capture_before_warm_up, 2, env=INTERPRET, timeout=180):
        error, value = rank_seen
        assert "gpucomm.all_reduce" in error and "run the same call once eagerly" in error, error
        assert value == "3.0"


def _captured_program_is_never_evicted(rank: int, world_size: int) -> bool:
    import torch

    import gpucomm
    import gpucomm.workspace.engine as engine_module

    gpucomm.init_process_group(transport="shm", kernels="torch")
    engine = gpucomm.get_default_communicator()._engines["cpu"]
    t = torch.ones(10)
    engine_module.capturing = lambda device: True  # this call is captured into a graph
    gpucomm.all_reduce(t)
    engine_module.capturing = lambda device: False
    captured = next(iter(engine._programs.values()))
    for n in range(1, engine_module._PROGRAM_CACHE + 20):  # more shapes than the cache holds
        gpucomm.all_reduce(torch.ones(n + 10))
    kept = any(p is captured for p in engine._programs.values())
    gpucomm.destroy_process_group()
    return kept


def test_a_program_a_graph_captured_outlives_the_cache():
    assert run_ranks(_captured_program_is_never_evicted, 2, timeout=180) == [True, True]


def _record_found_off_the_hot_path(rank: int, world_size: int) -> list[str]:
    import torch

    import gpucomm
    from gpucomm.errors import CommBrokenError, CommTimeoutError
    from gpucomm.ops.program import RECORD_WORDS, TIMEOUT

    gpucomm.init_process_group(**TRITON)
    t = torch.ones(8)
    gpucomm.all_reduce(t)
    gpucomm.check()  # nothing to report
    executor = gpucomm.get_default_communicator()._engines["cpu"].executor
    # What the kernel writes when a wait inside a replayed graph times out: [kind, epoch,
    # instruction, peers (a bit mask), seen, fingerprint], with nobody watching.
    record = executor.record.view(-1, RECORD_WORDS)
    peer = 1 - rank
    record[0, :6] = torch.tensor([TIMEOUT, 7, 0, 1 << peer, 0, 0])
    seen = []
    for call in (gpucomm.check, lambda: gpucomm.all_reduce(t)):
        try:
            call()
        except (CommTimeoutError, CommBrokenError) as err:
            seen.append(f"{type(err).__name__}: {err}")
    gpucomm.destroy_process_group()
    return seen


def test_a_timeout_inside_a_replayed_graph_is_not_silent():
    for rank, seen in enumerate(run_ranks(_record_found_off_the_hot_path, 2, env=INTERPRET, timeout=180)):
        assert len(seen) == 2, seen
        assert seen[0].startswith("CommTimeoutError") and f"[{1 - rank}]" in seen[0], seen[0]
        assert seen[1].startswith("CommBrokenError"), seen[1]


# -- 4. views of memory gpucomm did not allocate alias it -----------------------------------------
def test_an_alias_is_the_memory_itself_not_a_copy():
    """The mechanism behind the cuda_ipc peer views and the host executor's bindings, on CPU:
    the view's data_ptr() is the address, writes go both ways, and nothing is owned."""
    import torch

    from gpucomm.ops.contract import Region

    owner = torch.arange(16, dtype=torch.int32)
    region = Region.alias(owner.data_ptr() + 8, 16, torch.device("cpu"))
    assert region.bytes.data_ptr() == owner.data_ptr() + 8
    view = region.view(torch.int32)
    assert view.tolist() == [2, 3, 4, 5]
    view.fill_(-1)
    owner[5] = 50
    assert owner[2:6].tolist() == [-1, -1, -1, 50] and view.tolist() == [-1, -1, -1, 50]
    assert Region.alias(owner.data_ptr(), 0, torch.device("cpu")).bytes.numel() == 0
