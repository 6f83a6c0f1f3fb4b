"""The parameters of the CUDA C++ kernels, in the order and sizes of their ``extern "C"``
signatures, and the checks of a program or small launch's arguments before they are packed.

``*_PARAMS`` name and size each parameter (pointers and 64-bit integers 8 bytes, ``int`` 4);
``program_params``, ``small_params`` and ``copy_params`` carry a launch's values in them
(:mod:`gpucomm.ops.launcher` packs them).
"""

from __future__ import annotations

import torch

from gpucomm.ops.contract import SUPPORTED_DTYPES
from gpucomm.ops.cuda_source import program_kernel_name
from gpucomm.ops.instruction_set import FP_BITS, IDENT_BITS, OPERAND_WORDS, WORDS
from gpucomm.ops.launch_args import MAX_PROGRAM_WORLD, MAX_SMALL_WORLD, SMALL_OPS, ProgramArgs, SmallArgs
from gpucomm.ops.launcher import Param
from gpucomm.reduce_op import ReduceOp

__all__ = [
    "PROGRAM_FOLDS",
    "PROGRAM_PARAMS",
    "COPY_PARAMS",
    "SMALL_PARAMS",
    "REDUCE_PARAMS",
    "SIGNAL_PARAMS",
    "WAIT_PARAMS",
    "program_params",
    "copy_params",
    "small_params",
    "check_program",
    "check_small",
    "check_int",
]

# The folds the program kernels are built for: a program's AVG folds as SUM and each of its
# REDUCEs says whether it divides (gpucomm.ops.program).
PROGRAM_FOLDS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)


# The parameters of program.cu's kernels (GPUCOMM_PROGRAM_PARAMS) and of copy.cu's gpucomm_copy,
# with their sizes in bytes: pointers and 64-bit integers 8, int 4.
PROGRAM_PARAMS = (
    ("prog", 8),
    ("n_instr", 8),
    ("operands", 8),
    ("peers", 8),
    ("state", 8),
    ("record", 8),
    ("rank", 4),
    ("world", 4),
    ("fingerprint", 8),
    ("half_bytes", 8),
    ("granule", 8),
    ("timeout_ns", 8),
    ("all_channels", 4),
    ("ident_word", 8),
    ("ident0", 8),
    ("ident1", 8),
)
COPY_PARAMS = (("dst", 8), ("src", 8), ("nbytes", 8))
# The parameters of small.cu's kernels (GPUCOMM_SMALL_PARAMS): every rank's half 0 and flag area
# travel as parameters of their own, up to MAX_SMALL_WORLD ranks (0 past the workspace's).
SMALL_PARAMS = (
    ("x", 8),
    ("n", 8),
    *((f"stage{p}", 8) for p in range(MAX_SMALL_WORLD)),
    *((f"flags{p}", 8) for p in range(MAX_SMALL_WORLD)),
    ("half_bytes", 8),
    ("state", 8),
    ("record", 8),
    ("rank", 4),
    ("world", 4),
    ("fingerprint", 8),
    ("timeout_ns", 8),
    ("all_channels", 4),
    ("divisor", 8),
    ("ident_word", 8),
    ("ident0", 8),
    ("ident1", 8),
)
# reduce.cu's gpucomm_reduce_<op>_<dtype> and flags.cu's gpucomm_signal / gpucomm_wait.
REDUCE_PARAMS = (("out", 8), ("srcs", 8), ("k", 4), ("n", 8), ("divisor", 8))
SIGNAL_PARAMS = (("flag_addrs", 8), ("n", 4), ("epoch", 8))
WAIT_PARAMS = (("flag_addrs", 8), ("n", 4), ("epoch", 8), ("timeout_ns", 8), ("status", 8))


def program_params(args: ProgramArgs) -> list[Param]:
    """The program kernel's parameters (program.cu's GPUCOMM_PROGRAM_PARAMS) carrying a launch's values."""
    values = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in args.kernel_values()]
    return [Param(name, size, value) for (name, size), value in zip(PROGRAM_PARAMS, values, strict=True)]


def copy_params(dst: int, src: int, nbytes: int) -> list[Param]:
    """gpucomm_copy's parameters carrying a copy's addresses and size."""
    return [Param(name, size, value) for (name, size), value in zip(COPY_PARAMS, (dst, src, nbytes))]


def small_params(args: SmallArgs) -> list[Param]:
    """small.cu's parameters (GPUCOMM_SMALL_PARAMS) carrying a launch's values."""
    values = (
        args.x,
        args.n,
        *args.padded(args.stages),
        *args.padded(args.flags),
        args.half_bytes,
        args.state_addr,
        args.record_addr,
        args.rank,
        args.world,
        args.fingerprint,
        args.timeout_ns,
        args.all_channels,
        args.divisor,
        args.ident_word,
        *args.identity,
    )
    return [Param(name, size, value) for (name, size), value in zip(SMALL_PARAMS, values, strict=True)]


def check_program(device: torch.device, args: ProgramArgs) -> str:
    """The name of the program kernel for ``args`` (on the kernels' ``device``), once they are
    checked; cheaply, as it runs on every binding.

    Raises:
        TypeError: a table that is not an int64 tensor, a non-int number, an unsupported dtype.
        ValueError: a value out of its range, a table of the wrong size or device, an op that is
            not a fold.
    """
    fn = "CudaKernels.run_program"
    world, dtype, op = args.world, args.dtype, args.op
    check_int(fn, "world", world, 1, MAX_PROGRAM_WORLD)
    for name, table, width in (("instructions", args.instructions, WORDS), ("operands", args.operands, OPERAND_WORDS)):
        _check_table(fn, name, table, device)
        if table.numel() == 0 or table.numel() % width:
            raise ValueError(f"{fn}: {name} must hold a positive multiple of {width} int64, got {table.numel()}")
    _check_table(fn, "peers", args.peers, device)
    if args.peers.numel() != 2 * world:
        raise ValueError(f"{fn}: peers must hold 2 * world = {2 * world} addresses, got {args.peers.numel()}")
    check_int(fn, "rank", args.rank, 0, world - 1)
    check_int(fn, "channels", args.channels, 1, 2**31 - 1)
    check_int(fn, "all_channels", args.all_channels, args.channels, 2**31 - 1)
    check_int(fn, "fingerprint", args.fingerprint, 0, (1 << FP_BITS) - 1)
    _check_identity(fn, args.ident_word, args.identity)
    check_int(fn, "granule", args.granule, 1, 2**63 - 1)
    check_int(fn, "half_bytes", args.half_bytes, 0, 2**63 - 1)
    check_int(fn, "timeout_ns", args.timeout_ns, 0, 2**64 - 1)
    check_int(fn, "state_addr", args.state_addr, 1, 2**64 - 1)
    check_int(fn, "record_addr", args.record_addr, 1, 2**64 - 1)
    if dtype is None:
        return program_kernel_name(None, ReduceOp.SUM)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: dtype must be None or one of {list(SUPPORTED_DTYPES)}, got {dtype}")
    if isinstance(op, bool) or op not in PROGRAM_FOLDS:
        folds = [f"{int(f)} ({f.name})" for f in PROGRAM_FOLDS]
        raise ValueError(f"{fn}: op must be a fold, one of {folds} (AVG programs fold as SUM), got {op!r}")
    return program_kernel_name(dtype, ReduceOp(op))


def _check_table(fn: str, name: str, table: object, device: torch.device) -> None:
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(table).__name__}")
    if table.dtype != torch.int64:
        raise TypeError(f"{fn}: {name} must be an int64 tensor, got {table.dtype}")
    if table.dim() != 1 or not table.is_contiguous():
        raise ValueError(f"{fn}: {name} must be a contiguous 1-D tensor, got shape {tuple(table.shape)}")
    if table.device != device:
        raise ValueError(f"{fn}: {name} is on {table.device}, expected {device} (the kernels' device)")


def _check_identity(fn: str, ident_word: int, identity: tuple[int, int]) -> None:
    """The flag area's first identity slot and the call's identity words (gpucomm.ops.program.identity)."""
    check_int(fn, "ident_word", ident_word, 0, 2**63 - 1)
    if len(identity) != 2:
        raise ValueError(f"{fn}: identity must be two words, got {len(identity)}")
    for i, word in enumerate(identity):
        check_int(fn, f"identity[{i}]", word, 0, (1 << IDENT_BITS) - 1)


def check_int(fn: str, name: str, value: object, low: int, high: int) -> None:
    """Raise unless ``value`` is an int (not a bool) in ``[low, high]``; ``fn`` names the caller."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{fn}: {name} must be in [{low}, {high}], got {value}")


def check_small(args: SmallArgs) -> None:
    """Check a small launch's arguments before they are packed.

    Raises:
        TypeError: a non-int number or an unsupported dtype.
        ValueError: a value out of its range, or not one flag area per rank.
    """
    fn = "CudaKernels.prepare_small"
    check_int(fn, "world", len(args.stages), 1, MAX_SMALL_WORLD)
    if len(args.flags) != len(args.stages):
        raise ValueError(f"{fn}: one flag area per rank expected, got {len(args.flags)} for {len(args.stages)} ranks")
    check_int(fn, "rank", args.rank, 0, len(args.stages) - 1)
    check_int(fn, "channels", args.channels, 1, 2**31 - 1)
    check_int(fn, "all_channels", args.all_channels, args.channels, 2**31 - 1)
    check_int(fn, "fingerprint", args.fingerprint, 0, (1 << FP_BITS) - 1)
    _check_identity(fn, args.ident_word, args.identity)
    if args.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: dtype must be one of {list(SUPPORTED_DTYPES)}, got {args.dtype}")
    if args.op not in SMALL_OPS:
        raise ValueError(f"{fn}: op must be one of {[o.name for o in SMALL_OPS]}, got {args.op!r}")
