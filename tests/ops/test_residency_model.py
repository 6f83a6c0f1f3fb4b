"""gpucomm.ops.residency: the occupancy rule, and how many spinning blocks shut a waited block out.

Figures are worked by hand from the H100's limits (the CUDA programming guide's table for
compute capability 9.0): 64 K registers, 2048 threads, 32 blocks, 228 KiB shared per SM.
"""

from __future__ import annotations

import pytest

from gpucomm.ops.residency import H100, Footprint, SMLimits, blocks_per_sm, blocks_to_shut, spinning_grid

# 128 threads of 128 registers: 4 warps of 4096 registers, 16 K a block: 4 an SM.
HEAVY = Footprint(threads=128, registers=128, shared=17408)
# 96 registers (3072 a warp, 12 K a block) and 26 KiB of shared memory (+1 KiB reserved): 5 an SM.
LIGHT = Footprint(threads=128, registers=92, shared=25600)


@pytest.mark.parametrize(
    "block, expected",
    [
        (HEAVY, 4),  # registers
        (LIGHT, 5),  # registers: 92 rounds to 96
        (Footprint(threads=1024, registers=16, shared=0), 2),  # threads
        (Footprint(threads=32, registers=16, shared=0), 32),  # block slots
        (Footprint(threads=128, registers=32, shared=100 * 1024), 2),  # shared: 101 KiB a block
    ],
)
def test_blocks_per_sm(block: Footprint, expected: int) -> None:
    assert blocks_per_sm(block) == expected


def test_blocks_to_shut_is_the_fewest_that_leave_too_little() -> None:
    # 3 HEAVY blocks leave 16 K registers: a LIGHT block (12 K) fits; 4 leave none.
    assert blocks_to_shut(HEAVY, LIGHT) == 4
    # LIGHT blocks: 5 leave 4 K registers, less than a HEAVY block's 16 K; 4 leave 16 K, enough.
    assert blocks_to_shut(LIGHT, HEAVY) == 5
    # Tiny spinning blocks that cannot fill any resource of the SM before its 32 block slots do.
    tiny = Footprint(threads=32, registers=16, shared=0)
    assert blocks_to_shut(tiny, tiny) == 32


def test_spinning_grid_shares_what_leaves_a_place_among_the_ranks() -> None:
    capacity = H100.sms * 4 - 1  # 527 HEAVY blocks leave one SM a LIGHT block's room
    assert spinning_grid(10_000, HEAVY, LIGHT, 1) == capacity
    assert spinning_grid(10_000, HEAVY, LIGHT, 2) == capacity // 2
    assert spinning_grid(10_000, HEAVY, LIGHT, 4) == capacity // 4
    assert spinning_grid(3, HEAVY, LIGHT, 4) == 3  # never more programs than work
    # Whatever the ranks' launches, together they stay below 132 SMs x 4.
    assert all(r * spinning_grid(10_000, HEAVY, LIGHT, r) < H100.sms * 4 for r in range(1, 9))


def test_bad_input_is_a_typed_error_naming_the_function() -> None:
    with pytest.raises(ValueError, match=r"spinning_grid: work and ranks >= 1, got 0 and 1"):
        spinning_grid(0, HEAVY, LIGHT, 1)
    with pytest.raises(ValueError, match=r"blocks_per_sm: a block of at most 1024 threads"):
        blocks_per_sm(Footprint(threads=2048, registers=32, shared=0))
    small = SMLimits(sms=1)
    with pytest.raises(ValueError, match=r"spinning_grid: 8 ranks on a GPU of 1 SMs"):
        spinning_grid(100, HEAVY, LIGHT, 8, small)
