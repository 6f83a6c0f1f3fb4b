"""The program kernels repeat gpucomm.program's instruction set: every number the executor
writes into a table (opcodes, row and operand widths, the fingerprint's bits, the error record's
width and kinds) must mean the same in kernels/triton/program.py and kernels/cuda/program.cu."""

from __future__ import annotations

import re

import gpucomm.program as program
from gpucomm.ops.cuda_ops import kernel_source

# Every integer gpucomm.program exports is part of the instruction set.
NAMES = [name for name in program.__all__ if isinstance(getattr(program, name), int)]
EXPECTED = {name: getattr(program, name) for name in NAMES}


def test_the_instruction_set_is_what_the_kernels_are_checked_for() -> None:
    # Guards the list above: a rename in gpucomm.program would otherwise shrink what is checked.
    assert set(NAMES) == {"WORDS", "OPERAND_WORDS", "COPY", "REDUCE", "SYNC", "FP_BITS", "RECORD_WORDS", "TIMEOUT", "MISMATCH"}


def test_triton_program_kernel_reads_the_numbers() -> None:
    from gpucomm._kernels.triton import program as triton_program

    assert {name: getattr(triton_program, name) for name in NAMES} == EXPECTED
    # The constexpr copies the kernel itself reads (Triton sees only constexpr globals).
    for name in NAMES:
        copy = getattr(triton_program, f"_{name}", None)
        if copy is not None:
            assert copy.value == EXPECTED[name], name
    assert triton_program._FP_MASK.value == (1 << program.FP_BITS) - 1


def test_cuda_program_kernel_repeats_the_numbers() -> None:
    source = kernel_source("program.cu")
    found = {name: int(value) for name, value in re.findall(r"^constexpr\s+int\s+(\w+)\s*=\s*(\d+)\s*;", source, re.MULTILINE)}
    assert {name: found.get(name) for name in NAMES} == EXPECTED
