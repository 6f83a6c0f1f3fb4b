"""all_gather_matmul never starves itself: no block of its launches spins on a block that may not
get onto the GPU (tests/support/residency.py, the check; gpucomm.ops.residency, the model).

Launch 2's programs spin on the peers' launch 1. Where several ranks share one GPU, their launch
2 blocks may be resident before a peer's launch 1 is: if they hold every SM, that launch 1 never
runs, and nor do they. The shapes are the issue's real ones, M = N = K = 8192 in bf16 (each rank
a shard of M / world rows), in three layouts of an H100 node (132 SMs): 8 ranks one per GPU, 2
and 4 ranks sharing one GPU. What a block takes is read from the kernels compiled for sm_90 ahead
of time on this CPU machine (Triton, ptxas's register count): no GPU is needed.
"""

from __future__ import annotations

import pytest
from residency import Launch, compiled_footprints, violations

from gpucomm.ops.residency import H100

M = N = K = 8192
DTYPE = "bfloat16"
# Each rank's GPU, by rank.
LAYOUTS = {
    "8 ranks, one per GPU": [0, 1, 2, 3, 4, 5, 6, 7],
    "2 ranks sharing one GPU": [0, 0],
    "4 ranks sharing one GPU": [0, 0, 0, 0],
    "8 ranks, 4 on each of 2 GPUs": [0, 0, 0, 0, 1, 1, 1, 1],
}


@pytest.fixture(scope="module")
def footprints() -> dict:
    # Two kernels compiled for sm_90: about 15 s on an idle CPU machine, several times that on a busy one.
    return compiled_footprints(DTYPE)


def _launches(devices: list[int], publish_grid: int, matmul_grid: int, footprints: dict) -> list[Launch]:
    """Every rank's two launches on its own stream: launch 2 spins on every other rank's launch 1."""
    world = len(devices)
    out = []
    for r, device in enumerate(devices):
        stream = f"rank {r}"
        out.append(Launch(f"rank {r} launch 1", device, stream, 0, publish_grid, footprints["publish"]))
        others = tuple(f"rank {p} launch 1" for p in range(world) if p != r)
        out.append(Launch(f"rank {r} launch 2", device, stream, 1, matmul_grid, footprints["matmul"], others))
    return out


def test_the_recorded_footprints_are_the_compiled_kernels(footprints: dict) -> None:
    """prepare sizes launch 2 from fused_matmul.FOOTPRINTS: a kernel that takes more registers or
    shared memory than written there would get a grid that no longer leaves a place."""
    from gpucomm._kernels.triton import fused_matmul

    for name, compiled in footprints.items():
        recorded = fused_matmul.FOOTPRINTS[name, DTYPE]
        assert compiled.threads == recorded.threads, (name, compiled, recorded)
        assert compiled.registers <= recorded.registers and compiled.shared <= recorded.shared, (
            name,
            compiled,
            recorded,
        )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_block_of_all_gather_matmul_spins_on_one_that_may_not_be_resident(layout: str, footprints: dict) -> None:
    from gpucomm._kernels.triton import fused_matmul

    devices = LAYOUTS[layout]
    world = len(devices)
    ranks = max(devices.count(d) for d in devices)
    publish_grid, matmul_grid = fused_matmul.grids(M // world, N, world, DTYPE, ranks, H100)
    assert publish_grid > 0 and matmul_grid > 0
    found = violations(_launches(devices, publish_grid, matmul_grid, footprints), H100)
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("layout", ["2 ranks sharing one GPU", "4 ranks sharing one GPU"])
def test_the_check_fails_one_program_a_tile(layout: str, footprints: dict) -> None:
    """The check can fail: launch 2 on one program per tile of the other shards, as the kernels
    ran before the persistent grid, shuts the peers' launch 1 out of a shared GPU."""
    devices = LAYOUTS[layout]
    world = len(devices)
    tiles = (M // world // 64) * (N // 64)  # 64 x 64 tiles of a shard
    found = violations(_launches(devices, 16 + tiles, (world - 1) * tiles, footprints), H100)
    assert len(found) == world * (world - 1), found


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_the_recorded_footprints_of_the_other_dtypes_are_the_compiled_kernels(dtype: str) -> None:
    """As for bf16 above: fp16 and fp32 compile their own kernels (about 15 s more each, idle)."""
    from gpucomm._kernels.triton import fused_matmul

    for name, compiled in compiled_footprints(dtype).items():
        recorded = fused_matmul.FOOTPRINTS[name, dtype]
        assert compiled.threads == recorded.threads, (name, compiled, recorded)
        assert compiled.registers <= recorded.registers and compiled.shared <= recorded.shared, (
            name,
            compiled,
            recorded,
        )
