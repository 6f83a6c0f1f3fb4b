"""A kernel that runs what the Triton program kernel's REDUCE runs of its carried copies, for one
channel: ``carry_plan``, a share of ``quota`` bytes in each of ``steps`` steps of the fold, then the
rest (kernels/triton/program.py's ``_move``). tests/ops/test_triton_carry.py runs it under the
interpreter on host memory."""

import triton
import triton.language as tl

from gpucomm._kernels.triton.carry import carry_plan, carry_share

__all__ = ["carry_probe", "STEP_BYTES"]

# Bytes of the fold a share stands for (the program kernel's RSTEP at 8 threads and 16 loads).
STEP_BYTES = tl.constexpr(2048)


@triton.jit
def carry_probe(
    pos1,  # the first copy: its first byte's in-half position, its bytes
    n1,
    dst1,  # its destination and source addresses (of the byte at pos1)
    src1,
    pos2,  # the second copy, as the first
    n2,
    dst2,
    src2,
    granule,  # bytes of in-half positions a channel owns in turn
    channel,  # the channel this program plays
    channels,  # the grid it plays in
    fold,  # the REDUCE's bytes this channel owns: how many shares the plan cuts
    steps,  # shares taken before the rest (the fold's steps)
    COPY_ELEM: tl.constexpr,
    COPY_BYTES: tl.constexpr,
    ALIGNED: tl.constexpr,
    LANES: tl.constexpr,
):
    owned1, start2, total, quota = carry_plan(
        pos1, n1, pos2, n2, fold, STEP_BYTES, granule, channel, channels, COPY_BYTES, ALIGNED
    )
    cursor = total * 0
    for _ in range(0, steps):
        cursor = carry_share(
            cursor, tl.minimum(quota, total - cursor), owned1, start2, pos1, n1, dst1, src1, pos2, n2,
            dst2, src2, granule, channel, channels, COPY_ELEM, COPY_BYTES, ALIGNED, LANES,
        )  # fmt: skip
    carry_share(
        cursor, total - cursor, owned1, start2, pos1, n1, dst1, src1, pos2, n2, dst2, src2, granule,
        channel, channels, COPY_ELEM, COPY_BYTES, ALIGNED, LANES,
    )  # fmt: skip
