"""The numbers the device API and its host side share: the context table a kernel receives, the
flag bank's slots, the error record. Plain Python (no Triton), so that the engine can lay out its
flag area with them and the kernels can read them as constexprs.

The context table (int64, on the kernel's device; ``ctx`` in every device function)::

    [0] rank            [1] world size        [2] timeout (ns)     [3] error records' address
    [4] state address   [5] stage address     [6] stage half bytes [7] (reserved)
    [8 .. 8 + MAX_WORLD)                     each rank's flag bank, addressed in this process
    [REGIONS + i * REGION_WORDS + p]         region i's base in rank p, in this process
    [REGIONS + i * REGION_WORDS + MAX_WORLD] region i's size in bytes (0: no such region)

A *region* is memory every rank has mapped at the same offsets (the workspace's buffers; the
symmetric heap): a pointer into rank r's copy translates to rank p's by adding
``base[p] - base[r]``.

A rank's *flag bank* holds ``SLOTS x world`` int64 words: word ``(slot, writer)`` at
``slot * world + writer`` is written only by ``writer``, with release at system scope, and
never reset. Slots ``[0, CHANNEL_SLOTS)`` are the *channels*: ``barrier`` and gpucomm's own
kernels (the one-shot all_reduce, the fused ops) use channel c's slot from program c of a
launch, and keep every channel's epoch in step. Slots ``[CHANNEL_SLOTS, SLOTS)`` are free for
users' own flags.

The *state* words (the rank's own, after its bank): ``[poison, epoch of slot 0, ..., epoch of
slot SLOTS-1]``. A wait that times out writes the slot's error record and sets the poison: every
later wait of this context gives up at once (no second timeout to sit through) until the host
recovers the context (:meth:`gpucomm.language.DeviceContext.recover`).
"""

from __future__ import annotations

__all__ = [
    "MAX_WORLD", "CHANNEL_SLOTS", "USER_SLOTS", "SLOTS", "REGIONS_MAX",
    "RANK", "WORLD", "TIMEOUT_NS", "RECORD", "STATE", "STAGE", "STAGE_HALF", "FLAGS", "REGIONS", "REGION_WORDS",
    "TABLE_WORDS", "RECORD_WORDS", "TIMEOUT", "bank_words", "state_words",
]  # fmt: skip

# Ranks a context serves: a barrier's peers are lanes of one block's threads (64 <= 256), and the
# culprits of a timeout travel as an int64 bit mask.
MAX_WORLD = 63
# The channels: one per program of a launch, as many as the program kernel's most
# (gpucomm.workspace.channels.MAX_CHANNELS).
CHANNEL_SLOTS = 32
# Slots for users' own flags (all_gather_matmul uses none: it signals on the channels).
USER_SLOTS = 16
SLOTS = CHANNEL_SLOTS + USER_SLOTS
# Regions a pointer may lie in: the workspace, and the symmetric heap.
REGIONS_MAX = 2

RANK, WORLD, TIMEOUT_NS, RECORD, STATE, STAGE, STAGE_HALF = 0, 1, 2, 3, 4, 5, 6
FLAGS = 8
REGIONS = FLAGS + MAX_WORLD + 1
REGION_WORDS = MAX_WORLD + 1  # the bases of every rank, then the size
TABLE_WORDS = REGIONS + REGIONS_MAX * REGION_WORDS

# An error record per slot: [kind, value awaited, slot, culprits (bit mask of ranks), value seen,
# 0], the program kernel's fields (gpucomm.ops.program.RECORD_WORDS) with the slot where the program
# kernel has its instruction; the kind (TIMEOUT) is written last, with release.
RECORD_WORDS = 8
TIMEOUT = 1


def bank_words(world_size: int) -> int:
    """Words of one rank's flag bank."""
    return SLOTS * world_size


def state_words() -> int:
    """Words of one rank's state: the poison and an epoch per slot."""
    return 1 + SLOTS
