"""The instruction set is written once, in gpucomm.ops.instruction_set: the builder, the Triton
kernels and the CUDA C++ kernels (through the loader's -D options) all read that module's numbers
(opcodes, row and operand widths, the fingerprint's bits, the error record's width and kinds, the
reduce ops), and the kernels' dtype map is written once too. And the Triton program kernel, run
on its own under the interpreter, reduces as the reference."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import gpucomm.ops.instruction_set as isa
import gpucomm.ops.program as program
from gpucomm.ops.cuda_ops import HEADER, SOURCES, compile_options, kernel_source
from gpucomm.ops.launch_args import ProgramArgs
from gpucomm.reduce_op import ReduceOp

# Every integer gpucomm.ops.instruction_set exports is part of the instruction set.
NAMES = [name for name in isa.__all__ if isinstance(getattr(isa, name), int)]
EXPECTED = {name: getattr(isa, name) for name in NAMES}
KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"


def test_the_instruction_set_is_what_the_kernels_are_checked_for() -> None:
    # Guards the list above: a rename in gpucomm.ops.instruction_set would otherwise shrink what is checked.
    assert set(NAMES) == {
        "WORDS",
        "OPERAND_WORDS",
        "COPY",
        "REDUCE",
        "SYNC",
        "STORE_ALSO",
        "CARRIED",
        "FP_BITS",
        "FP_MASK",
        "IDENT_WORDS",
        "IDENT_BITS",
        "IDENT_MASK",
        "IDENT_TAG_MASK",
        "RECORD_WORDS",
        "TIMEOUT",
        "MISMATCH",
        "SMALL_SYNC_INSTRUCTION",
        "OP_SUM",
        "OP_PRODUCT",
        "OP_MIN",
        "OP_MAX",
        "OP_AVG",
    }
    assert isa.FP_MASK == (1 << isa.FP_BITS) - 1
    assert isa.IDENT_MASK == (1 << isa.IDENT_BITS) - 1
    # A tagged identity word stays a non-negative int64.
    assert isa.IDENT_TAG_MASK.bit_length() + isa.IDENT_BITS == 63
    assert [isa.OP_SUM, isa.OP_PRODUCT, isa.OP_MIN, isa.OP_MAX, isa.OP_AVG] == [int(op) for op in ReduceOp]


def test_the_builder_reads_the_instruction_set() -> None:
    for name in ("WORDS", "OPERAND_WORDS", "COPY", "REDUCE", "SYNC", "FP_BITS", "RECORD_WORDS", "TIMEOUT", "MISMATCH"):
        assert getattr(program, name) == EXPECTED[name], name


def test_triton_kernels_read_the_numbers() -> None:
    from gpucomm._kernels.triton import _common
    from gpucomm._kernels.triton import program as triton_program
    from gpucomm._kernels.triton import small as triton_small

    exported = [name for name in triton_program.__all__ if name in EXPECTED]
    assert {name: getattr(triton_program, name) for name in exported} == {name: EXPECTED[name] for name in exported}
    # The constexpr copies the kernels themselves read (Triton sees only constexpr globals).
    for module in (triton_program, triton_small):
        for name in NAMES:
            copy = getattr(module, f"_{name}", None)
            if copy is not None:
                assert copy.value == EXPECTED[name], (module.__name__, name)
    assert triton_program._FP_MASK.value == isa.FP_MASK
    # The small kernel's SYNC is the program kernel's.
    assert triton_small.meet is triton_program.meet
    assert triton_small.SYNC_INSTRUCTION == isa.SMALL_SYNC_INSTRUCTION
    for name in ("OP_SUM", "OP_PRODUCT", "OP_MIN", "OP_MAX", "OP_AVG"):
        assert getattr(_common, name).value == EXPECTED[name], name


def test_triton_kernels_name_the_reduce_ops_and_dtypes_once() -> None:
    # An op compared with a bare number, or a dtype map of a kernel's own, is a second copy of a fact.
    for path in sorted((KERNELS / "triton").glob("*.py")):
        text = path.read_text()
        assert not re.search(r"\bOP\s*==\s*\d", text), path.name
        if path.name != "types.py":
            assert "torch.float32: tl.float32" not in text, path.name
            assert not re.search(r"\{\s*8:\s*tl\.int64", text), path.name


def test_cuda_kernels_get_the_numbers_from_the_loader() -> None:
    options = compile_options("sm_90", {})
    for name in isa.cuda_defines():
        assert f"-D{name}={isa.cuda_defines()[name]}" in options, name
    assert isa.cuda_defines() == {
        f"GPUCOMM_{name}": EXPECTED[name]
        for name in NAMES
        if name not in ("FP_MASK", "IDENT_MASK") and not name.startswith("OP_")
    }
    header = kernel_source(HEADER)
    for name in isa.cuda_defines():
        short = name.removeprefix("GPUCOMM_")
        assert re.search(rf"constexpr int {short} = {name};", header), short
    # No source writes a number of the instruction set itself.
    for file in (HEADER, *SOURCES):
        found = re.findall(r"constexpr\s+int\s+(\w+)\s*=\s*\d+\s*;", kernel_source(file))
        assert not set(found) & set(NAMES), (file, found)


def test_channels_grow_with_the_program_and_stop_at_the_layout() -> None:
    from gpucomm.workspace.channels import BYTES_PER_CHANNEL, launch_channels, layout_channels

    assert launch_channels(8, 32) == 1  # a small message: one block
    assert launch_channels(BYTES_PER_CHANNEL, 32) == 1
    assert launch_channels(BYTES_PER_CHANNEL + 1, 32) == 2
    assert launch_channels(1 << 30, 32) == 32
    assert launch_channels(1 << 30, 6) == 6
    assert launch_channels(0, 6) == 1
    cpu = torch.device("cpu")
    assert layout_channels(0, "triton", cpu, 8) == 1  # the interpreter: one
    assert layout_channels(3, "triton", cpu, 8) == 3  # GPUCOMM_CHANNELS
    assert layout_channels(3, "torch", cpu, 8) == 1  # the host executor


# ------------------------------------------------- the Triton program kernel, under the interpreter
# One program of local buffers (no workspace operand, SYNCs that name no peer) run by the real
# launcher: REDUCEs of 1 to 11 sources, fewer or more than a launch of 4 ranks loads at once (4), checked
# bit for bit against the torch reference; and a launch of fewer channels than the flag layout
# has, which must still advance every channel's epoch.

WORLD = 4  # the launcher loads a power of two >= world, at most 8, sources at once: 4 here
FOLDS = [
    (torch.bfloat16, ReduceOp.SUM),
    (torch.float16, ReduceOp.AVG),
    (torch.float32, ReduceOp.PRODUCT),
    (torch.float64, ReduceOp.MAX),
    (torch.int64, ReduceOp.MIN),
]
KERNEL_CASES = {
    f"{str(dtype).split('.')[-1]}-{op.name}-k{k}-n{n}-{'aligned' if aligned else 'odd'}-grid{grid}of{flags}": (
        dtype,
        op,
        k,
        n,
        aligned,
        grid,
        flags,
    )
    for dtype, op in FOLDS
    for k in (1, 3, 4, 6, 11)
    for n, aligned, grid, flags in ((4099, True, 3, 5), (7, False, 1, 1))
}


def _run_case(dtype: torch.dtype, op: ReduceOp, k: int, n: int, aligned: bool, grid: int, flags: int) -> str:
    """One program on TritonKernels under the interpreter; '' if it matches, else what differs."""
    from gpucomm.ops import get_kernels
    from gpucomm.ops.contract import Region
    from gpucomm.ops.reference import TorchKernels

    gen = torch.Generator().manual_seed(k * 1000 + n)
    skew = 0 if aligned else 1  # one element in: addresses off the 16-byte grid

    def buffer() -> torch.Tensor:
        if dtype.is_floating_point:
            whole = torch.randn(n + skew, generator=gen, dtype=torch.float64).to(dtype)
        else:
            whole = torch.randint(-(2**40), 2**40, (n + skew,), generator=gen, dtype=dtype)
        return whole[skew:]

    srcs = [buffer() for _ in range(k)]
    out, want = buffer(), torch.empty(n, dtype=dtype)
    divisor = 3
    TorchKernels().reduce(Region.of(want), [Region.of(s) for s in srcs], dtype, op, divisor)

    nbytes = out.numel() * out.element_size()
    fold = ReduceOp.SUM if op is ReduceOp.AVG else op
    divides = int(op is ReduceOp.AVG)
    sync = [isa.SYNC, 0, 0, 0, 0, 0, 0, 0]
    rows = [*sync, isa.REDUCE, nbytes, 0, k, 0, divides, divisor, 0, *sync]
    operands = [word for t in (out, *srcs) for word in (-1, 0, t.data_ptr())]
    scratch = torch.zeros(16, dtype=torch.int64)
    peers = torch.full((2 * WORLD,), scratch.data_ptr(), dtype=torch.int64)
    epoch = 41
    state = torch.tensor([0] + [epoch] * flags, dtype=torch.int64)
    record = torch.zeros(flags * isa.RECORD_WORDS, dtype=torch.int64)
    # One contiguous share per channel, as the executor lays a program out.
    granule = max(16, -(-nbytes // grid // 16) * 16)
    get_kernels("triton", torch.device("cpu")).run_program(
        ProgramArgs(
            torch.tensor(rows, dtype=torch.int64),
            torch.tensor(operands, dtype=torch.int64),
            peers,
            state.data_ptr(),
            record.data_ptr(),
            channels=grid,
            rank=0,
            world=WORLD,
            fingerprint=5,
            half_bytes=0,
            granule=granule,
            timeout_ns=10**9,
            dtype=dtype,
            op=int(fold),
            copy_bytes=8 if aligned else 1,
            aligned=aligned,
            all_channels=flags,
        )
    )
    problems = []
    got_bits, want_bits = out.view(-1).clone(), want
    if dtype.is_floating_point:
        got_bits = got_bits.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()])
        want_bits = want.view(got_bits.dtype)
    differ = (got_bits != want_bits).nonzero().flatten()
    if differ.numel():
        i = int(differ[0])
        problems.append(f"{differ.numel()} element(s) differ, first at {i}: {out[i].item()!r} vs {want[i].item()!r}")
    if state.tolist() != [0] + [epoch + 2] * flags:
        problems.append(f"state after 2 SYNCs: {state.tolist()}, expected [0] + [{epoch + 2}] * {flags}")
    if record.any():
        problems.append(f"error record written: {record.tolist()}")
    return "; ".join(problems)


def _worker() -> dict[str, str]:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("test_program worker: run with TRITON_INTERPRET=1")
    return {name: _run_case(*case) for name, case in KERNEL_CASES.items()}


@pytest.fixture(scope="module")
def triton_verdicts() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"interpreter worker failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_triton_program_kernel_reduces_like_the_reference_and_keeps_every_epoch(triton_verdicts, case: str) -> None:
    if triton_verdicts[case]:
        pytest.fail(triton_verdicts[case], pytrace=False)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
