"""The program cache names a call's buffers by address, never by the caller's tensors, and keeps
what a CUDA graph captured; shown on CPU (the GPU halves: tests/gpu/test_program_cache_gpu.py).

- Fresh tensors on every call do not grow a rank's memory, and a new tensor at an old address
  is read and written, not a stale copy.
- Capturing a call shape that never ran eagerly raises an error that says what to do; a program
  a graph captured is never evicted; a timeout inside a replayed graph is raised by the next check
  or call.
- The aliases the executors bind are the memory itself, not copies.
"""

from __future__ import annotations

from spawn import run_ranks


# -- the cache keeps addresses, never the caller's tensors ----------------------------------------
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
    """350 all_reduce calls on fresh 4 MiB tensors: the rank's resident set grows by a few MiB, and
    not at all after the first hundred calls. Measured: 24 MiB, all of it in the first 50 calls; a
    cache holding views of the 256 tensors it keeps grew it by 1.4 GiB."""
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


# -- CUDA graphs (the capture state faked on CPU) -------------------------------------------------
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


# -- views of memory gpucomm did not allocate alias it -------------------------------------------
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
