"""The arguments of one launch of the program kernel (:class:`ProgramArgs`) and of the small kernel
(:class:`SmallArgs`), each written once.

The executors build them (:mod:`gpucomm.workspace.device_executor`, :mod:`gpucomm.workspace.small`);
the kernels' launchers take them whole (``prepare_program`` and ``prepare_small`` of
:mod:`gpucomm.ops.triton_ops` and :mod:`gpucomm.ops.cuda_ops`), and so do the Triton kernels'
own packers (``kernels/triton/program.py``, ``kernels/triton/small.py``). Both are frozen and
hold addresses and sizes, never the caller's tensors: a launch is packed once from them and
replayed as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpucomm.ops.instruction_set import WORDS
from gpucomm.reduce_op import ReduceOp

__all__ = ["ProgramArgs", "SmallArgs", "MAX_PROGRAM_WORLD", "MAX_SMALL_WORLD", "SMALL_OPS"]

# A SYNC names its peers in an int64 bit mask (program.cu's MAX_PEERS - 1).
MAX_PROGRAM_WORLD = 63
# The small kernels take every rank's half 0 and flag area as parameters of their own, this many
# of each (0 past the workspace's ranks).
MAX_SMALL_WORLD = 8
# The small kernels fold with every op, AVG included (it divides once at the end).
SMALL_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)


@dataclass(frozen=True)
class ProgramArgs:
    """One launch of the program kernel: a program's tables on one workspace, over ``channels``
    blocks (kernels/triton/program.py's docstring says what the kernel does with each).

    ``all_channels`` (default ``channels``) is how many channels the flag layout has, whose
    epochs the launch keeps in step. ``dtype`` and ``op`` are the program's REDUCEs' (None and
    any op for a program without one; ``op`` a fold, AVG folding as SUM). ``copy_bytes`` (the
    widest unit dividing every COPY) and ``aligned`` (every address and position a multiple of
    16 bytes) let the Triton kernel pick its access width; the CUDA kernel picks its own.
    """

    instructions: torch.Tensor  # int64[n_instr * WORDS] on the kernels' device
    operands: torch.Tensor  # int64[OPERAND_WORDS * operands]
    peers: torch.Tensor  # int64[2 * world]: every rank's half 0, then every rank's flag area
    state_addr: int  # this rank's state words: [poison, epoch of channel 0, ...]
    record_addr: int  # this rank's error records, RECORD_WORDS int64 per channel
    channels: int  # the launch's grid
    rank: int  # this rank, in the workspace
    world: int  # ranks of the workspace (<= MAX_PROGRAM_WORLD)
    fingerprint: int  # of the call: every flag carries it (< 2**FP_BITS); identity words beside it
    half_bytes: int  # bytes from half 0 to half 1
    granule: int  # bytes of in-half positions a channel owns in turn
    timeout_ns: int  # a wait gives up after this long
    dtype: torch.dtype | None  # element type of the REDUCEs
    op: int  # gpucomm.ReduceOp value of their fold
    copy_bytes: int  # the widest unit (8, 4, 2, 1) dividing every COPY's size, position and addresses
    aligned: bool  # every address and position is a multiple of 16 bytes
    all_channels: int | None = None  # channels of the flag layout (None: ``channels``)
    # Where the flag area's identity slots start (int64 words; gpucomm.workspace.layout.FlagLayout),
    # and the call's two identity words (gpucomm.ops.program.identity), stored beside each flag.
    # Words (0, 0): no identity, the kernels store and compare none (tables a test makes by hand).
    ident_word: int = 0
    identity: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if self.all_channels is None:
            object.__setattr__(self, "all_channels", self.channels)

    def kernel_values(self) -> tuple:
        """The kernel's run-time arguments in the order both kernels declare them (program.cu's
        GPUCOMM_PROGRAM_PARAMS, kernels/triton/program.py's ``program_kernel``): the tables as
        tensors (Triton takes them as pointers, the CUDA packer their addresses)."""
        return (
            self.instructions,
            self.instructions.numel() // WORDS,
            self.operands,
            self.peers,
            self.state_addr,
            self.record_addr,
            self.rank,
            self.world,
            self.fingerprint,
            self.half_bytes,
            self.granule,
            self.timeout_ns,
            self.all_channels,
            self.ident_word,
            *self.identity,
        )


@dataclass(frozen=True)
class SmallArgs:
    """One launch of the small-message all_reduce (:mod:`gpucomm.workspace.small`): the ``n``
    elements of ``dtype`` at ``x`` reduced in place with ``op`` over ``channels`` blocks.

    ``stages`` and ``flags`` are every rank's half 0 and flag area, by rank, addressed in this
    process (``len(stages)`` ranks, at most MAX_SMALL_WORLD). ``all_channels`` is how many
    channels the flag layout has; AVG divides the fold by ``divisor`` once.
    """

    x: int  # the tensor's address
    n: int  # its elements
    stages: Sequence[int]  # every rank's half 0
    flags: Sequence[int]  # every rank's flag area
    half_bytes: int  # bytes from half 0 to half 1
    state_addr: int  # this rank's state words: [poison, epoch of channel 0, ...]
    record_addr: int  # this rank's error records
    rank: int  # this rank, in the workspace
    fingerprint: int  # of the call: every flag carries it
    timeout_ns: int  # a wait gives up after this long
    channels: int  # the launch's grid
    all_channels: int  # channels of the flag layout, >= channels
    divisor: int  # AVG's
    dtype: torch.dtype  # element type
    op: ReduceOp  # one of SMALL_OPS
    ident_word: int = 0  # where the flag area's identity slots start (as ProgramArgs')
    identity: tuple[int, int] = (0, 0)  # the call's identity words, stored beside each flag

    @property
    def world(self) -> int:
        return len(self.stages)

    def padded(self, addrs: Sequence[int]) -> tuple[int, ...]:
        """``addrs`` (one per rank) followed by zeros up to MAX_SMALL_WORLD: the kernels' one
        parameter per rank."""
        return (*addrs, *[0] * (MAX_SMALL_WORLD - len(addrs)))
