"""The program kernels on one GPU, in one process: ``run_program`` of TritonKernels and of
CudaKernels on tables made by the real Builder and DeviceExecutor, over a workspace whose other
ranks the test plays itself (their halves and flag areas are tensors of this process).

- COPY and REDUCE: bit for bit TorchKernels' results (on CPU, the oracle) for every op × dtype,
  1 and 3 channels, 16-byte aligned and odd offsets; a reduce of 70 sources (more than the CUDA
  kernel resolves into shared memory);
- a REDUCE storing into a second destination (STORE_ALSO) and carrying one or two COPYs (CARRIED),
  every destination byte TorchKernels' (tests/support/carried_programs.py: the cases
  tests/ops/test_carried_programs.py also runs on CPU);
- epochs on the device: every launch advances each channel's epoch, and the halves alternate;
- channels by size: a small program runs one block, and every launch keeps every channel's epoch;
- SYNC: a channel decides a timeout once, all its warps together, also when the late rank
  arrives at the deadline; a rank that never comes gives a TIMEOUT record (kind, epoch, instruction, culprit mask,
  value seen, fingerprint) after the timeout, a flag of another call at this epoch a MISMATCH
  record at once; either poisons every later launch; a flag one epoch ahead counts as arrived,
  also where ``e << FP_BITS`` wraps around int64.

Skipped without CUDA; the CUDA C++ kernels also need CuPy.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from carried_programs import CASES as CARRIED_CASES
from carried_programs import run_case as run_carried_case
from program_workspace import HALF_BYTES, Workspace, tables
from reduce_bits import DIVISOR, GUARD, assert_same_bits, poison_value, random_buffers, reduce_into_last

from gpucomm.ops.contract import SUPPORTED_DTYPES, Region
from gpucomm.ops.cuda_source import THREADS
from gpucomm.ops.launch_args import ProgramArgs
from gpucomm.ops.program import FP_BITS, MISMATCH, RECORD_WORDS, TIMEOUT, Program
from gpucomm.ops.reference import TorchKernels
from gpucomm.reduce_op import ReduceOp

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module", params=["triton", "cuda"])
def kernels(request: pytest.FixtureRequest, device: torch.device):
    if request.param == "cuda":
        pytest.importorskip("cupy", reason="CudaKernels needs CuPy")
        from gpucomm.ops.cuda_ops import CudaKernels

        return CudaKernels(device)
    from gpucomm.ops.triton_ops import TritonKernels

    return TritonKernels(device)


@pytest.fixture
def gen() -> torch.Generator:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")  # shown by pytest on failure
    return torch.Generator().manual_seed(seed)


def _wrap(value: int) -> int:
    """``value`` as int64 arithmetic leaves it (two's complement)."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _barrier(ws: Workspace) -> Program:
    """A program of one SYNC: rank 0 signals and waits for every other rank."""
    b = ws.builder("barrier")
    b.sync()  # a program's first sync is a full barrier
    return b.finish()


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("n", [1, 4099])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda op: op.name)
def test_copy_and_reduce_match_torch_bitwise(
    kernels, device, gen, op, dtype, n: int, aligned: bool, channels: int
) -> None:
    k = 3
    elem = torch.empty(0, dtype=dtype).element_size()
    offsets = [16 // elem if aligned else 2 * i + 1 for i in range(k + 1)]
    cpu = random_buffers(dtype, op, [off + n + GUARD for off in offsets], gen, special="")
    want = reduce_into_last(TorchKernels(), [b.clone() for b in cpu], offsets, n, dtype, op)
    bufs = [b.to(device) for b in cpu]
    bufs[-1].fill_(poison_value(dtype))
    regions = [Region.of(b).sub(off * elem, n * elem) for b, off in zip(bufs, offsets)]
    # An odd number of bytes copied too, from and to 16-byte aligned or odd addresses.
    nbytes = n * elem + 5
    copy_src = torch.randint(0, 256, (nbytes + 48,), generator=gen, dtype=torch.uint8)
    copy_want = torch.full_like(copy_src, 0xA5)
    src_off, dst_off = (16, 32) if aligned else (3, 6)
    copy_want[dst_off : dst_off + nbytes] = copy_src[src_off : src_off + nbytes]
    copy_src_gpu, copy_dst = copy_src.to(device), torch.full_like(copy_src, 0xA5).to(device)

    ws = Workspace(device, 1, channels)
    b = ws.builder()
    b.reduce(regions[-1], regions[:-1], dtype, op, DIVISOR)
    b.copy(Region.of(copy_dst).sub(dst_off, nbytes), Region.of(copy_src_gpu).sub(src_off, nbytes))
    program = b.finish()
    assert tables(program, channels, device)["aligned"] == aligned
    ws.run(kernels, program)
    what = f"{kernels.name} {op.name} {dtype} n={n} channels={channels}"
    assert_same_bits(bufs[-1], want, what)  # guards included
    assert torch.equal(copy_dst.cpu(), copy_want), what
    assert ws.epochs() == [0] * channels and not ws.poisoned()


@pytest.mark.parametrize("case", list(CARRIED_CASES))
def test_store_also_and_carried_copies_match_torch_bitwise(kernels, device, gen, case: str) -> None:
    # tests/support/carried_programs.py builds, runs and checks each case; tests/ops/test_carried_programs.py
    # runs the same cases on CPU. Sizes count in the fold's vector body at the GPU build's block size.
    seed = int(torch.randint(0, 1 << 30, (1,), generator=gen))
    problems = run_carried_case(kernels, device, CARRIED_CASES[case], seed, THREADS)
    assert not problems, f"{kernels.name} {case} seed {seed}: {problems}"


def test_reduce_of_70_sources(kernels, device, gen) -> None:
    # The CUDA kernel resolves the first 64 operands of an instruction into shared memory and
    # reads the others from the operand table: both must count, in order.
    n, k = 4099, 70
    cpu = [torch.randint(-1000, 1000, (n,), generator=gen).to(torch.float32) for _ in range(k)]
    srcs = [t.to(device) for t in cpu]
    out = torch.full((n,), float("nan"), device=device)
    ws = Workspace(device, 1, 2)
    b = ws.builder()
    b.reduce(Region.of(out), [Region.of(t) for t in srcs], torch.float32, ReduceOp.SUM)
    ws.run(kernels, b.finish())
    want = torch.stack([t.double() for t in cpu]).sum(0).float()  # integers: exact in fp32
    assert torch.equal(out.cpu(), want)


def test_every_launch_advances_the_epochs_and_alternates_the_halves(kernels, device) -> None:
    channels, count = 3, 1000
    ws = Workspace(device, 1, channels)
    x = torch.arange(count, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    b = ws.builder()
    b.copy(b.slot(0, b.write_offset(), 4 * count), Region.of(x))
    b.sync()
    b.copy(Region.of(y), b.slot(0, b.read_offset(), 4 * count))
    program = b.finish()
    for launch in range(4):
        x += 1
        y.fill_(float("nan"))
        ws.run(kernels, program)
        assert ws.epochs() == [launch + 1] * channels
        # The epoch at the start of launch L is L: its round 0 lives in half L % 2.
        half = ws.halves[0][launch % 2 * HALF_BYTES :][: 4 * count].view(torch.float32)
        assert torch.equal(half, x) and torch.equal(y, x), launch
    assert not ws.poisoned() and not any(r[0] for r in ws.records())


def _compile_barrier(kernels, device: torch.device, channels: int) -> None:
    """Run a barrier whose peer has arrived: compiles the kernel, so that timings after it
    measure the wait alone."""
    ws = Workspace(device, 2, channels)
    program = _barrier(ws)
    for c in range(channels):
        ws.flag(0, c, 1).fill_(1 << FP_BITS | program.fingerprint)
    ws.run(kernels, program)
    assert ws.epochs() == [1] * channels and not ws.poisoned()


def _failed_channels(ws: Workspace, record: list[int]) -> list[int]:
    """The channels that wrote ``record`` and advanced their epoch to 1. Every other channel must
    have done nothing: it started after a failed channel had poisoned the workspace (the
    interpreter runs channels one after the other; on a GPU they may or may not overlap)."""
    failed = []
    for c, (got, epoch) in enumerate(zip(ws.records(), ws.epochs())):
        assert (got, epoch) in ((record, 1), ([0] * RECORD_WORDS, 0)), (c, got, epoch)
        if epoch:
            failed.append(c)
    assert failed and ws.poisoned(), ws.records()
    return failed


def test_a_rank_that_never_comes_gives_a_timeout_record_and_poisons(kernels, device) -> None:
    channels, timeout = 2, 0.3
    _compile_barrier(kernels, device, channels)
    ws = Workspace(device, 2, channels)
    program = _barrier(ws)
    fp = program.fingerprint
    start = time.monotonic()
    ws.run(kernels, program, timeout_s=timeout)
    elapsed = time.monotonic() - start
    # Channels that overlap wait together; one after the other, only the first waits at all.
    assert timeout * 0.9 <= elapsed < channels * timeout + 1.0, elapsed
    # [kind, epoch, instruction, culprit mask, value seen, fingerprint, unused, unused]
    failed = _failed_channels(ws, [TIMEOUT, 1, 0, 0b10, 0, fp, 0, 0])
    for c in range(channels):  # a channel that ran signalled rank 1 before its wait gave up
        assert ws.flag(1, c, 0).item() == (1 << FP_BITS | fp if c in failed else 0), c
        ws.flag(1, c, 0).zero_()
    records, epochs = ws.records(), ws.epochs()
    ws.run(kernels, program, timeout_s=timeout)  # poisoned: does nothing at all
    assert ws.records() == records and ws.epochs() == epochs
    assert [ws.flag(1, c, 0).item() for c in range(channels)] == [0] * channels


def test_a_flag_of_another_call_gives_a_mismatch_record_at_once(kernels, device) -> None:
    channels = 2
    _compile_barrier(kernels, device, channels)
    ws = Workspace(device, 2, channels)
    program = _barrier(ws)
    fp = program.fingerprint
    other = 1 << FP_BITS | fp ^ 1  # rank 1 at this epoch, in another collective
    for c in range(channels):
        ws.flag(0, c, 1).fill_(other)
    start = time.monotonic()
    ws.run(kernels, program, timeout_s=60.0)
    assert time.monotonic() - start < 5.0  # not at the deadline
    _failed_channels(ws, [MISMATCH, 1, 0, 0b10, other, fp, 0, 0])


@pytest.mark.parametrize("start_epoch", [0, (1 << (63 - FP_BITS)) - 2], ids=["epoch0", "wraparound"])
def test_a_flag_one_epoch_ahead_counts_as_arrived(kernels, device, start_epoch: int) -> None:
    # From the second start, this sync's flags are just below 2**63 and the peer's next epoch is
    # past it (negative as int64): only a wraparound-safe comparison sees it as arrived.
    channels = 2
    ws = Workspace(device, 2, channels)
    ws.state[1:] = start_epoch
    program = _barrier(ws)
    fp = program.fingerprint
    e = start_epoch + 1
    for c in range(channels):
        ws.flag(0, c, 1).fill_(_wrap((e + 1) << FP_BITS | fp))
    ws.run(kernels, program)
    assert not ws.poisoned() and not any(r[0] for r in ws.records()), ws.records()
    assert ws.epochs() == [e] * channels
    assert [ws.flag(1, c, 0).item() for c in range(channels)] == [_wrap(e << FP_BITS | fp)] * channels


def _timeout_outcomes(ws: Workspace, fp: int, late: int) -> list[str]:
    """What each channel did at a barrier where rank ``late`` may have missed the deadline: one
    of 'arrived', 'timeout' (its record names exactly that rank) or 'skipped' (poisoned first).
    A channel whose threads disagreed would show anything else, or hang the launch."""
    outcomes = []
    for c, (got, epoch) in enumerate(zip(ws.records(), ws.epochs())):
        if (got, epoch) == ([0] * RECORD_WORDS, 1):
            outcomes.append("arrived")
        elif (got, epoch) == ([TIMEOUT, 1, 0, 1 << late, 0, fp, 0, 0], 1):
            outcomes.append("timeout")
        elif (got, epoch) == ([0] * RECORD_WORDS, 0) and ws.poisoned():
            outcomes.append("skipped")
        else:
            raise AssertionError(f"channel {c}: record {got}, epoch {epoch}")
    return outcomes


@pytest.mark.parametrize("race", [False, True], ids=["never", "at-the-deadline"])
def test_a_timeout_is_decided_once_per_channel(kernels, device, race: bool) -> None:
    # Issue 21, item 5: every thread of a channel reads the clock, but the channel decides the
    # deadline once, so all its warps leave the wait together and its record is one verdict.
    # Ranks 1 and 3 have arrived, rank 2 has not; with `race`, rank 2 arrives about when the
    # deadline passes, so that threads reading the clock at different moments would disagree.
    channels, timeout, late = 8, 0.05, 2
    _compile_barrier(kernels, device, channels)
    side = torch.cuda.Stream(device)
    for attempt in range(10):
        ws = Workspace(device, 4, channels)
        program = _barrier(ws)
        fp = program.fingerprint
        arrived = 1 << FP_BITS | fp
        for c in range(channels):
            ws.flag(0, c, 1).fill_(arrived)
            ws.flag(0, c, 3).fill_(arrived)
        torch.cuda.synchronize(device)
        start = time.monotonic()
        form = tables(program, channels, device)
        kernels.run_program(
            ProgramArgs(
                form["instructions"],
                form["operands"],
                ws.peers,
                ws.state.data_ptr(),
                ws.record.data_ptr(),
                channels=channels,
                rank=0,
                world=ws.world,
                fingerprint=fp,
                half_bytes=HALF_BYTES,
                granule=form["granule"],
                timeout_ns=int(timeout * 1e9),
                dtype=program.dtype,
                op=0,
                copy_bytes=form["copy_bytes"],
                aligned=form["aligned"],
            )
        )
        if race:
            time.sleep(timeout * (0.8 + 0.04 * attempt))  # from just before to just after the deadline
            with torch.cuda.stream(side):
                for c in range(channels):
                    ws.flag(0, c, late).fill_(arrived)
        torch.cuda.synchronize(device)
        assert time.monotonic() - start < channels * timeout + 2.0
        outcomes = _timeout_outcomes(ws, fp, late)
        if not race:
            assert "arrived" not in outcomes and "timeout" in outcomes, outcomes


def test_a_small_program_runs_one_channel_and_keeps_every_epoch(kernels, device) -> None:
    # 8 bytes: one block of the 6 the flag layout has; a 1 MiB program then runs all 6 (16 with
    # 64 KiB each, capped), and starts from the epoch the small one left in every channel.
    channels = 6
    ws = Workspace(device, 1, channels, half_bytes=1 << 20)  # halves that hold the 1 MiB program
    for count in (2, 1 << 18):
        x = torch.arange(count, dtype=torch.float32, device=device)
        y = torch.full_like(x, float("nan"))
        b = ws.builder()
        b.copy(b.slot(0, b.write_offset(), 4 * count), Region.of(x))
        b.sync()
        b.copy(Region.of(y), b.slot(0, b.read_offset(), 4 * count))
        program = b.finish()
        grid = tables(program, channels, device, by_size=True)["channels"]
        assert grid == (1 if count == 2 else channels), grid
        ws.run(kernels, program, by_size=True)
        assert torch.equal(y, x), count
    assert ws.epochs() == [2] * channels and not ws.poisoned()
