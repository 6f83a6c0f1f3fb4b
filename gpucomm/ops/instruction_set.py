"""The program kernels' instruction set: every number the host writes into a table and the kernels read.

The program builder (:mod:`gpucomm.ops.program`), the executors, the Triton kernels
(``kernels/triton``) and the CUDA C++ kernels (``kernels/cuda``) take these numbers from here and
nowhere else: the Python modules import them, and the CUDA sources receive them as ``-D`` options
(:func:`cuda_defines`, passed by :func:`gpucomm.ops.cuda_ops.compile_options`), so that a change
here reaches every kernel at its next compile.

An instruction is ``WORDS`` int64 (its opcode first), an operand ``OPERAND_WORDS`` int64, a
channel's error record ``RECORD_WORDS`` int64 (the kernels' docstrings lay them out). A flag holds
``epoch << FP_BITS | fingerprint``; beside each flag, in the flag area's identity slots, the
writer stores the call's ``IDENT_WORDS`` identity words before it releases the flag, each
``(epoch & IDENT_TAG_MASK) << IDENT_BITS | identity`` (:func:`gpucomm.ops.program.identity`).
The reduce ops are :class:`gpucomm.ReduceOp`'s values, as the kernels' ``OP`` constexpr carries
them.
"""

from __future__ import annotations

from gpucomm.reduce_op import ReduceOp

__all__ = [
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
    "OP_SUM",
    "OP_PRODUCT",
    "OP_MIN",
    "OP_MAX",
    "OP_AVG",
    "SMALL_SYNC_INSTRUCTION",
    "cuda_defines",
]

WORDS = 8  # int64 per instruction
OPERAND_WORDS = 3  # int64 per operand: [rank or -1, round, offset or address]
COPY, REDUCE, SYNC = 1, 2, 3  # opcodes: an instruction's first word
# A REDUCE's flags (its word 7, which it used to leave 0): STORE_ALSO, the operand after its k
# sources is a second destination that gets the same result (gpucomm.ops.program.Builder.reduce).
STORE_ALSO = 1
# A COPY's flag (its word 7): CARRIED, the REDUCE right before it (or before the carried COPY right
# before it) runs it inside its own loop, the copy's loads in flight beside the fold's; an executor
# that does not fuse runs it alone, in order, with the same result (their bytes are disjoint).
CARRIED = 1
FP_BITS = 20  # low bits of a flag: the call's fingerprint; above them: the epoch
FP_MASK = (1 << FP_BITS) - 1
# Identity words per flag: the call's exact dtype and count, and 48 bits of a hash of the rest.
IDENT_WORDS = 2
IDENT_BITS = 48  # low bits of an identity word: the call's; above them: the epoch's tag
IDENT_MASK = (1 << IDENT_BITS) - 1
# The epoch's low 15 bits tag each word (a word stays non-negative): a reader tells the words of
# its own epoch from a later epoch's (the slot's next writer: ops/program.py, "Identity").
IDENT_TAG_MASK = (1 << 15) - 1
RECORD_WORDS = 8  # int64 per channel's error record: [kind, epoch, instruction, peers, seen, fingerprint]
TIMEOUT, MISMATCH = 1, 2  # kinds of error record
# The instruction a small kernel's error record names: the SYNC of the program it stands for
# (COPY, SYNC, REDUCE).
SMALL_SYNC_INSTRUCTION = 1

# The reduce ops as the kernels see them (a constexpr OP): gpucomm.ReduceOp's values.
OP_SUM = int(ReduceOp.SUM)
OP_PRODUCT = int(ReduceOp.PRODUCT)
OP_MIN = int(ReduceOp.MIN)
OP_MAX = int(ReduceOp.MAX)
OP_AVG = int(ReduceOp.AVG)

# What the CUDA sources are given, by the name they read it under.
_CUDA_NAMES = (
    "WORDS",
    "OPERAND_WORDS",
    "COPY",
    "REDUCE",
    "SYNC",
    "STORE_ALSO",
    "CARRIED",
    "FP_BITS",
    "IDENT_WORDS",
    "IDENT_BITS",
    "IDENT_TAG_MASK",
    "RECORD_WORDS",
    "TIMEOUT",
    "MISMATCH",
    "SMALL_SYNC_INSTRUCTION",
)


def cuda_defines() -> dict[str, int]:
    """The instruction set as the CUDA sources read it: ``{"GPUCOMM_<NAME>": value}`` for each
    number above (kernels/cuda/common.cuh turns them into constants and refuses to compile
    without them)."""
    values = globals()
    return {f"GPUCOMM_{name}": values[name] for name in _CUDA_NAMES}
