"""Zero copies for captured graphs (gpucomm.workspace.graph_buffers): inside gpucomm.graph_capture,
an all_reduce (or broadcast) captured on an ordinary tensor whose memory every rank can map
replays in place, with no copy-in or copy-out, and with the copy path's bits; a tensor no peer can
map keeps the copy path and says so; outside graph_capture every captured call keeps the copy path.

The replay runs on the CPU as tests/workspace/test_cuda_bound_launch.py's does: the CUDA C++
program kernel built for the host, launched through gpucomm's launcher to the driver double,
which records the captured launch and runs it again at each cuGraphLaunch with the parameters it
was captured with. A tensor in a shared mapping of a /dev/shm file stands for one in a caching
allocator segment (its handle: the file); an ordinary CPU tensor (anonymous memory) for one that
cannot be shared.
"""

from __future__ import annotations

import os

import cuda_double
import pytest
import torch
from spawn import run_ranks

from gpucomm.algorithms import allreduce
from gpucomm.ops.contract import Region
from gpucomm.ops.program import Builder
from gpucomm.reduce_op import ReduceOp
from gpucomm.toolchain import native
from gpucomm.workspace import graph_buffers
from gpucomm.workspace.graph_segments import OpenedSegments, _in_segments, locate

N = 4099  # not a multiple of 16 bytes: the kernels' scalar tails run too
OFFSET = 64  # elements into the shared file: the tensor is not at its segment's start
ROOT = 1  # the broadcast's


def _input(rank: int, k: int, n: int = N) -> torch.Tensor:
    # Random floats: (a + b) + c and a + (b + c) differ in their last bits, so a fold in another
    # order than the copy path's would show in a bitwise comparison.
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * k + rank))


def _install(double: str) -> None:
    from cuda_kernels_double import cuda_kernels_running_on_the_double

    from gpucomm.ops import registry

    registry.install("cuda", "cpu", cuda_kernels_running_on_the_double(double))


class _CallerStream:
    """The caller's stream order on a GPU: False from to_caller while the stream captures."""

    def __init__(self) -> None:
        self.capturing = False

    def to_caller(self) -> bool:
        return not self.capturing


def _slot_rows(table: torch.Tensor, operands: int) -> int:
    """Operands of a bound operand table in the workspace's halves (a row [peer, round, offset]
    with a peer; -1 names an address): what the kernel that reads the table stages there. Only the
    program's ``operands`` rows count (a program with none has a placeholder row)."""
    return int((table.view(-1, 3)[:operands, 0] >= 0).sum())


def _staged(call) -> int:  # noqa: ANN001
    """Workspace operands in the operand table a captured in-place call's replay reads."""
    from gpucomm.workspace.device_executor import operand_rows

    return _slot_rows(call.bound["operands"], len(operand_rows(call.program, (call.addr,))))


def _captured(rank: int, world_size: int, double: str, algo: str, shm_path: str) -> dict:
    try:
        return _capture_and_replay(rank, world_size, double, algo, f"{shm_path}-{rank}")
    finally:
        if os.path.exists(f"{shm_path}-{rank}"):
            os.unlink(f"{shm_path}-{rank}")


def _capture_and_replay(rank: int, world_size: int, double: str, algo: str, path: str) -> dict:
    import contextlib
    import ctypes
    import logging

    import gpucomm
    import gpucomm.workspace.device_executor as device_executor

    _install(double)
    gpucomm.init_process_group(transport="shm", kernels="cuda", algo=algo, timeout=60)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("gpucomm").addHandler(handler)
    comm = gpucomm.get_default_communicator()
    engine = comm._engines["cpu"]
    executor = engine.executor
    # The executor's GPU branch on the CPU device (as test_cuda_bound_launch.py's replay).
    order, stream = _CallerStream(), [0xE1]
    executor._on_gpu, executor._stream, engine.order = True, lambda: stream[0], order
    device_executor.capturing = lambda device: order.capturing
    torch.cuda.device = lambda device: contextlib.nullcontext()
    torch._C._cuda_getDevice = lambda: executor.device.index
    segment = torch.from_file(path, shared=True, size=2 * N + 3 * OFFSET, dtype=torch.float32)
    shared = segment[OFFSET : OFFSET + N]  # in a shareable segment, at an offset
    sent = segment[2 * OFFSET + N : 2 * OFFSET + 2 * N]  # a broadcast's, in the same segment
    ordinary = torch.empty(N)  # anonymous memory: no peer can open it
    for t in (shared, ordinary):  # the warm-up the capture needs: the copy path's programs
        t.copy_(_input(rank, 0))
        gpucomm.all_reduce(t)
    gpucomm.broadcast(sent, src=ROOT)
    lib = ctypes.CDLL(double)
    said.clear()
    # Captured: recorded, not run.
    first = _capture(
        gpucomm.graph_capture(),  # registers the calls captured in place on leaving
        lib,
        order,
        stream,
        lambda: (gpucomm.all_reduce(shared), gpucomm.all_reduce(ordinary), gpucomm.broadcast(sent, src=ROOT)),
    )
    capture_lines = [line for line in said if "captured" in line]
    (buffers,) = executor.graphs._registered
    inplace, inplace_broadcast = buffers.calls
    copy_program = next(
        p for p in engine._programs.values() if (ordinary.data_ptr(),) in p.cache.get("device", {}).get("bound", {})
    )
    copy_table = copy_program.cache["device"]["bound"][(ordinary.data_ptr(),)]["operands"]
    same_bits = []
    for k in (6, 7):
        shared.copy_(_input(rank, k))
        ordinary.copy_(_input(rank, k))
        sent.copy_(_input(rank, 100 + k))
        assert lib.cuGraphLaunch(first, ctypes.c_void_p(0xF2)) == 0
        reference = _input(rank, k)
        gpucomm.all_reduce(reference)  # eager: the copy path
        same_bits.append(torch.equal(shared, reference) and torch.equal(ordinary, reference))
        same_bits.append(torch.equal(sent, _input(ROOT, 100 + k)))
    result = {
        "same_bits": same_bits,
        # Counted from what the replayed kernels read: the in-place call's operand table in memory.
        "inplace_staged": _staged(inplace) + _staged(inplace_broadcast),
        "inplace_program_staged": graph_buffers.staged_copies(inplace.program)
        + graph_buffers.staged_copies(inplace_broadcast.program),
        "copy_staged": _slot_rows(copy_table, copy_table.numel() // 3),
        "copy_path_calls": executor.graphs.copy_path_calls,
        "capture_lines": capture_lines,
    }
    # A second graph over the same tensor, its segments released with it: the peers' segments are
    # not opened again, and outlive the second graph while the first uses them.
    graph = _Graph()
    second = _capture(comm.graph_capture(graph), lib, order, stream, lambda: gpucomm.all_reduce(shared))
    result["opened"] = executor.graphs.segments.opens

    def replay(exec_: object, k: int) -> bool:
        shared.copy_(_input(rank, k))
        assert lib.cuGraphLaunch(exec_, ctypes.c_void_p(0xF2)) == 0
        reference = _input(rank, k)
        gpucomm.all_reduce(reference)
        return torch.equal(shared, reference)

    later_bits = [replay(second, 8)]
    del graph  # the second graph is gone: its segments go with it, where the first does not use them
    result["open_after_second_freed"] = len(executor.graphs.segments)
    later_bits.append(replay(first, 9))
    result["later_same_bits"] = later_bits
    # Outside graph_capture a captured call keeps the copy path: nothing to register before its
    # replay, which is right at once (graphs captured before gpucomm did this stay as they were).
    said.clear()
    plain = _capture(contextlib.nullcontext(), lib, order, stream, lambda: gpucomm.all_reduce(shared))
    result["plain_pending"] = len(executor.graphs._pending) + len([line for line in said if "captured" in line])
    result["plain_same_bits"] = replay(plain, 10)
    gpucomm.destroy_process_group()
    result["open_after_close"] = len(executor.graphs.segments)
    return result


class _Graph:
    """Stands for a torch.cuda.CUDAGraph: something its segments live as long as."""


def _capture(around, lib, order: _CallerStream, stream: list, calls) -> object:  # noqa: ANN001
    """An instantiated graph of what ``calls`` launches, captured on the driver double inside the
    context ``around`` (gpucomm.graph_capture, or a context that does nothing)."""
    import ctypes

    graph, exec_ = ctypes.c_void_p(), ctypes.c_void_p()
    with around:
        assert lib.cuStreamBeginCapture_v2(ctypes.c_void_p(0xC0), 0) == 0
        order.capturing, stream[0] = True, 0xC0
        calls()
        order.capturing, stream[0] = False, 0xE1
        assert lib.cuStreamEndCapture(ctypes.c_void_p(0xC0), ctypes.byref(graph)) == 0
    assert lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0) == 0
    return exec_


@pytest.mark.skipif(native.load("launch") is None, reason="gpucomm's launcher cannot be built here (no C compiler)")
# With GPUCOMM_DEBUG=INFO every call takes the full path (and says how it was captured); without
# it the warm-up's calls are learned by the host's fast path, whose kept launch is captured.
@pytest.mark.parametrize(("algo", "debug"), [("oneshot", True), ("twoshot", False)])
def test_a_replayed_all_reduce_on_ordinary_tensors_moves_no_copy_and_keeps_the_copy_paths_bits(
    algo: str, debug: bool
) -> None:
    double = cuda_double.build()
    world = 3  # three ranks: a fold in another order would change the bits
    shm_path = f"/dev/shm/gpucomm-test-graph-{os.getpid()}-{algo}"
    for result in run_ranks(
        _captured, world, double, algo, shm_path, env={"GPUCOMM_DEBUG": "INFO"} if debug else {}, timeout=600
    ):
        assert result["same_bits"] == [True] * 4
        assert result["inplace_staged"] == 0 and result["inplace_program_staged"] == 0
        assert result["copy_staged"] > 0  # the ordinary tensor's captured launch stages through the halves
        assert result["opened"] == world - 1  # each peer's segment once, for both graphs
        assert result["later_same_bits"] == [True, True]
        assert result["plain_pending"] == 0 and result["plain_same_bits"]
        assert result["open_after_second_freed"] == world - 1  # the first graph still reads them
        assert result["open_after_close"] == 0  # released with the communicator at the latest
        assert result["copy_path_calls"] == 1
        if not debug:
            assert result["capture_lines"] == []
            continue
        (inplace_line, copy_line, broadcast_line) = result["capture_lines"]
        assert "all_reduce" in inplace_line and "captured in place" in inplace_line
        assert "broadcast" in broadcast_line and "captured in place" in broadcast_line
        assert "captured with the copy path" in copy_line and "not in a shared mapping" in copy_line, copy_line


def test_a_segment_is_found_by_address_and_unshareable_ones_say_why(tmp_path) -> None:
    path = f"/dev/shm/gpucomm-test-segment-{os.getpid()}"
    whole = torch.from_file(path, shared=True, size=256, dtype=torch.float32)
    try:
        found = locate(whole[10:].data_ptr(), torch.device("cpu"))
        assert (found.reason, found.name, found.offset, found.size) == ("", path, 40, 1024)
        assert found.handle().startswith(b"shm:")
    finally:
        os.unlink(path)
    gone = locate(whole.data_ptr(), torch.device("cpu"))
    assert "unlinked" in gone.reason
    assert "not in a shared mapping" in locate(torch.ones(8).data_ptr(), torch.device("cpu")).reason
    private = tmp_path / "file"
    on_disk = torch.from_file(str(private), shared=True, size=16, dtype=torch.float32)
    assert "not in a shared mapping of a /dev/shm file" in locate(on_disk.data_ptr(), torch.device("cpu")).reason
    with pytest.raises(Exception, match=r"Allocation.handle: this segment cannot be shared"):
        gone.handle()


def test_a_caching_allocator_segment_is_shareable_unless_expandable_or_on_another_device() -> None:
    snapshot = [
        {"device": 0, "address": 0x7000_0000, "total_size": 2 << 20},
        {"device": 0, "address": 0x8000_0000, "total_size": 20 << 20, "is_expandable": True},
        {"device": 1, "address": 0x9000_0000, "total_size": 2 << 20},
    ]
    plain = _in_segments(snapshot, 0x7000_0200, 0)
    assert (plain.reason, plain.base, plain.offset) == ("", 0x7000_0000, 0x200)
    assert "expandable segment" in _in_segments(snapshot, 0x8000_1000, 0).reason
    assert "no segment of torch's caching allocator on cuda:0" in _in_segments(snapshot, 0x9000_0000, 0).reason


def test_each_handle_is_opened_once() -> None:
    path = f"/dev/shm/gpucomm-test-open-{os.getpid()}"
    whole = torch.from_file(path, shared=True, size=64, dtype=torch.float32)
    try:
        handle = locate(whole.data_ptr(), torch.device("cpu")).handle()
        opened = OpenedSegments()
        first, again = opened.take(handle), opened.take(handle)
        assert first == again and opened.opens == 1
        whole[3] = 7.0
        assert Region.alias(first, 256, torch.device("cpu")).view(torch.float32)[3] == 7.0  # the peer's bytes
        opened.drop(handle)
        assert len(opened) == 1  # one user left
        opened.drop(handle)
        assert len(opened) == 0 and opened.opens == 1
    finally:
        os.unlink(path)


def test_the_in_place_program_stages_nothing_and_the_copy_path_does() -> None:
    t = torch.ones(1000)
    region = Region.of(t)
    copy = Builder(0, 4, 1 << 16, "all_reduce", ("f",), args=[region])
    allreduce.oneshot(copy, t, ReduceOp.SUM)
    assert graph_buffers.staged_copies(copy.finish()) > 0
    bases = [graph_buffers._token(p) for p in range(4)]
    bases[0] = t.data_ptr()
    inplace = Builder(0, 4, 1 << 16, "all_reduce", ("f",), args=[region], heap=bases)
    allreduce.twoshot_symmetric(inplace, t, ReduceOp.SUM)
    assert graph_buffers.staged_copies(inplace.finish()) == 0


def test_a_segment_closes_with_the_last_graph_that_reads_it() -> None:
    import weakref

    path = f"/dev/shm/gpucomm-test-graphs-{os.getpid()}"
    whole = torch.from_file(path, shared=True, size=64, dtype=torch.float32)
    try:
        handle = locate(whole.data_ptr(), torch.device("cpu")).handle()
        opened = OpenedSegments()
        graphs = [graph_buffers.GraphBuffers(opened, [handle], []) for _ in range(2)]
        opened.take(handle), opened.take(handle)
        stand_in = _Graph()
        weakref.finalize(stand_in, graphs[1].release)
        del stand_in  # the second graph is freed
        assert len(opened) == 1 and opened.opens == 1
        graphs[0].release()
        graphs[0].release()  # idempotent: no second drop
        assert len(opened) == 0
    finally:
        os.unlink(path)


def test_the_ranks_keep_the_copy_path_where_one_cannot_share_or_their_addresses_sit_apart() -> None:
    members = [0, 1, 2]
    assert graph_buffers._why_not(["1 0", "1 0", "1 0"], members) == ""
    why = graph_buffers._why_not(["1 0", "0 its segment is an expandable segment", "1 0"], members)
    assert why == "rank 1's tensor cannot be shared: its segment is an expandable segment"
    assert "different addresses modulo 16 bytes (['0', '8'])" in graph_buffers._why_not(["1 0", "1 8", "1 0"], members)
