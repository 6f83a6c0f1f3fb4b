"""CudaKernels on a GPU: bit for bit the results of TorchKernels (on CPU, the oracle) and of
TritonKernels, for every op × dtype at odd sizes and unaligned offsets; copy at every alignment;
signal/wait, including timeouts. The program kernels (tests/gpu/test_program_kernels.py) are
checked the same way.

Skipped without CUDA or without CuPy.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from reduce_bits import GUARD, assert_same_bits, random_buffers, reduce_into_last

from gpucomm.ops.contract import SUPPORTED_DTYPES, Region
from gpucomm.ops.reference import TorchKernels
from gpucomm.reduce_op import ReduceOp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SIZES = (1, 7, 4099)
KS = (1, 3, 5)


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def cuda_kernels(device: torch.device):
    pytest.importorskip("cupy", reason="CudaKernels needs CuPy")
    from gpucomm.ops.cuda_ops import CudaKernels

    return CudaKernels(device)


# How CudaKernels reaches the driver: gpucomm's launcher (the default), or CuPy's Function (where
# the launcher cannot be built). Results on an H100 did not follow CuPy's launches; these tests
# run both, so that one run says which.
LAUNCH_PATHS = ("launcher", "cupy")


def _kernels_launched_by(device: torch.device, path: str):  # noqa: ANN202
    pytest.importorskip("cupy", reason="CudaKernels needs CuPy")
    from gpucomm.ops.cuda_ops import CudaKernels

    kernels = CudaKernels(device, launcher=path == "launcher")
    if path == "launcher" and kernels._driver is None:
        pytest.skip("gpucomm's launcher cannot be built here (GPUCOMM_NATIVE=0 or no C compiler)")
    return kernels


@pytest.fixture(scope="module")
def triton_kernels(device: torch.device):
    from gpucomm.ops.triton_ops import TritonKernels

    return TritonKernels(device)


@pytest.fixture
def gen() -> torch.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown by pytest on failure
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda op: op.name)
def test_reduce_matches_torch_and_triton_bitwise(
    cuda_kernels, triton_kernels, device, gen, op: ReduceOp, dtype: torch.dtype, n: int, k: int, aligned: bool
) -> None:
    elem = torch.empty(0, dtype=dtype).element_size()
    # Aligned: every region starts 16 bytes in (the vector path). Unaligned: odd element offsets,
    # different for every buffer (the scalar path).
    offsets = [16 // elem if aligned else 2 * i + 1 for i in range(k + 1)]
    cpu = random_buffers(dtype, op, [off + n + GUARD for off in offsets], gen, special="")
    want = reduce_into_last(TorchKernels(), [b.clone() for b in cpu], offsets, n, dtype, op)
    for kernels in (cuda_kernels, triton_kernels):
        got = reduce_into_last(kernels, [b.to(device) for b in cpu], offsets, n, dtype, op)
        torch.cuda.synchronize(device)
        assert_same_bits(got, want, f"{kernels.name} {op.name} {dtype} n={n} k={k}")  # guards included


@pytest.mark.parametrize("special", ["nan", "subnormal"])
@pytest.mark.parametrize("dtype", [d for d in SUPPORTED_DTYPES if d.is_floating_point], ids=str)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda op: op.name)
def test_reduce_nan_and_subnormals_match_torch(cuda_kernels, device, gen, op, dtype, special: str) -> None:
    # NaN must propagate through MIN/MAX like torch.minimum/maximum; subnormals must survive
    # (NVRTC is run with -ftz=false).
    n, offsets = 4099, [0, 0, 0, 0]
    cpu = random_buffers(dtype, op, [n + GUARD] * 4, gen, special)
    want = reduce_into_last(TorchKernels(), [b.clone() for b in cpu], offsets, n, dtype, op)
    got = reduce_into_last(cuda_kernels, [b.to(device) for b in cpu], offsets, n, dtype, op)
    assert_same_bits(got, want, f"{op.name} {dtype} {special}")


def test_reduce_out_may_alias_a_source(cuda_kernels, device, gen) -> None:
    dtype, n = torch.float32, 4099
    cpu = random_buffers(dtype, ReduceOp.SUM, [n] * 3, gen, special="")
    want = cpu[0] + cpu[1] + cpu[2]
    bufs = [b.to(device) for b in cpu]
    regions = [Region.of(b) for b in bufs]
    cuda_kernels.reduce(regions[1], regions, dtype, ReduceOp.SUM)
    assert_same_bits(bufs[1], want, "out aliasing srcs[1]")


@pytest.mark.parametrize("nbytes", [0, 1, 7, 4099, 4099 * 8 + 3, 1 << 20])
@pytest.mark.parametrize("dst_off, src_off", [(0, 0), (16, 48), (8, 24), (4, 12), (2, 6), (3, 0), (1, 1), (5, 13)])
def test_copy_every_alignment(cuda_kernels, device, gen, nbytes: int, dst_off: int, src_off: int) -> None:
    size = max(dst_off, src_off) + nbytes + 16
    src = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
    dst = torch.full((size,), 0xA5, dtype=torch.uint8)
    want = dst.clone()
    want[dst_off : dst_off + nbytes] = src[src_off : src_off + nbytes]
    dst_gpu, src_gpu = dst.to(device), src.to(device)
    cuda_kernels.copy(Region.of(dst_gpu).sub(dst_off, nbytes), Region.of(src_gpu).sub(src_off, nbytes))
    assert torch.equal(dst_gpu.cpu(), want)


def _flags(device: torch.device, values: list[int]) -> tuple[torch.Tensor, list[Region]]:
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    whole = Region.of(tensor)
    return tensor, [whole.sub(8 * i, 8) for i in range(len(values))]


def test_signal_then_wait(cuda_kernels, device) -> None:
    tensor, flags = _flags(device, [0, 0, 0, 0])
    cuda_kernels.signal(flags, 5)
    assert tensor.tolist() == [5, 5, 5, 5]
    assert cuda_kernels.wait(flags, 5, time.monotonic() + 5.0) == []
    assert cuda_kernels.wait(flags, 4, time.monotonic() + 5.0) == []  # flags are >= epoch


def test_wait_sees_a_signal_from_another_stream(cuda_kernels, device) -> None:
    tensor, flags = _flags(device, [0, 0])
    other = torch.cuda.Stream(device)
    with torch.cuda.stream(other):
        torch.cuda._sleep(50_000_000)  # ~tens of ms: the wait kernel is spinning by then
        cuda_kernels.signal(flags, 3)
    start = time.monotonic()
    assert cuda_kernels.wait(flags, 3, start + 10.0) == []
    other.synchronize()
    assert tensor.tolist() == [3, 3]


@pytest.mark.parametrize("path", LAUNCH_PATHS)
def test_wait_times_out_with_the_missing_indices_by_the_deadline(device, path: str) -> None:
    kernels = _kernels_launched_by(device, path)
    _, ready = _flags(device, [7])
    assert kernels.wait(ready, 7, time.monotonic() + 10.0) == []  # compiles flags.cu: no part of the timed wait
    _, flags = _flags(device, [7, 7, 2, 7, 0])
    timeout = 0.2
    start = time.monotonic()
    missing = kernels.wait(flags, 7, start + timeout)
    elapsed = time.monotonic() - start
    # Both in one message: [] after ~0 s says the host read the record before the kernel wrote
    # it (the launch not on torch's stream); [] after ~0.2 s says the kernel ran and recorded no
    # timeout.
    assert (missing, timeout * 0.9 <= elapsed < timeout + 0.1) == ([2, 4], True), (missing, elapsed)


@pytest.mark.parametrize("side_stream", [False, True], ids=["default-stream", "side-stream"])
@pytest.mark.parametrize("path", LAUNCH_PATHS)
def test_each_launch_runs_in_order_on_torchs_current_stream(device, path: str, side_stream: bool) -> None:
    """What came before a launch on torch's current stream is done when it runs, and what comes
    after waits for it: inputs written behind a sleep, the result read back at once. A launch on
    any other stream reads the old inputs (or is read unfinished)."""
    kernels = _kernels_launched_by(device, path)
    n = 1 << 24  # 64 MiB of fp32 per buffer: a reduce takes tens of microseconds, a copy as long
    a, b, out, copied = (torch.zeros(n, device=device) for _ in range(4))
    two, three = [Region.of(a), Region.of(b)], [Region.of(a), Region.of(b), Region.of(out)]
    # Once before: the address tables' first upload waits for the stream (a pageable copy), which
    # would order the timed launches by itself.
    kernels.reduce(Region.of(out), two, torch.float32, ReduceOp.SUM)
    kernels.reduce(Region.of(out), three, torch.float32, ReduceOp.SUM)
    kernels.copy(Region.of(copied), Region.of(out))
    out.zero_()
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device) if side_stream else torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # ~10 ms at H100 clocks: far longer than any launch takes
        a.fill_(1.0)
        b.fill_(2.0)
        kernels.reduce(Region.of(out), two, torch.float32, ReduceOp.SUM)
        kernels.copy(Region.of(copied), Region.of(out))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernels.reduce(Region.of(out), three, torch.float32, ReduceOp.SUM)
        end.record()
        got_copy, got_out = copied[[0, n - 1]].tolist(), out[[0, n - 1]].tolist()
    end.synchronize()
    assert (got_copy, got_out) == ([3.0, 3.0], [6.0, 6.0]), (path, got_copy, got_out)
    # The events must hold the reduce: it moves 4 x 64 MiB through HBM (three reads, one write),
    # which cannot go much faster than torch's copy_ moves bytes on this GPU, measured here (the
    # fastest of three 64 MiB copies, 2 x 64 MiB each). On an H100 the Triton reduce reached
    # 101-104% of copy_'s bandwidth (docs/results/2026-11-25-h100.md), while the
    # events around CuPy's reduce there said 4-12 times copy_'s: 1.5 sits between the two, and
    # holds on any GPU (an H200 copies ~4.3 TB/s, a fixed 4 TB/s bound failed it).
    reduce_bw = 4 * n * 4 / (start.elapsed_time(end) / 1e3)
    copy_bw = 2 * n * 4 / _fastest_copy_s(copied, a, 3)
    assert reduce_bw < 1.5 * copy_bw, (path, reduce_bw / 1e12, copy_bw / 1e12)


def _fastest_copy_s(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` ``dst.copy_(src)`` on the current stream, by CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return min(times)


def test_sources_compile_once_per_instance(cuda_kernels, device) -> None:
    before = len(cuda_kernels._modules)
    out = torch.empty(7, device=device)
    cuda_kernels.reduce(Region.of(out), [Region.of(torch.ones(7, device=device))], torch.float32, ReduceOp.MAX)
    cuda_kernels.reduce(Region.of(out), [Region.of(torch.ones(7, device=device))], torch.float32, ReduceOp.MIN)
    assert len(cuda_kernels._modules) <= before + 1  # reduce.cu, compiled at most once
    assert torch.equal(out.cpu(), torch.ones(7))
