"""The kernels' bit-for-bit checks against TorchKernels (on CPU, the oracle): random buffers, a
reduce of them into the last, and a comparison of bits. Shared by tests/gpu/test_cuda_kernels.py
and tests/gpu/test_program_kernels.py.
"""

from __future__ import annotations

import torch

from gpucomm.ops.contract import Region
from gpucomm.reduce_op import ReduceOp

__all__ = ["DIVISOR", "GUARD", "assert_same_bits", "bits", "poison_value", "random_buffers", "reduce_into_last"]

DIVISOR = 3  # AVG: 1/3 is inexact in binary, so the division's rounding is exercised
GUARD = 5  # poisoned elements after every region


def poison_value(dtype: torch.dtype) -> float | int:
    """What an output is filled with before a kernel writes it: NaN, or an unlikely integer."""
    return float("nan") if dtype.is_floating_point else -0x5A5A5A5A


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the elements, NaNs made canonical (their payloads may differ)."""
    t = t.cpu()
    if t.is_floating_point():
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Raise AssertionError naming ``what``, the count and the first element where the bits differ."""
    differ = (bits(got) != bits(want)).nonzero().flatten()
    if differ.numel():
        i = int(differ[0])
        raise AssertionError(
            f"{what}: {differ.numel()} element(s) differ, first at {i}: {got[i].item()!r} vs {want[i].item()!r}"
        )


def random_buffers(
    dtype: torch.dtype, op: ReduceOp, sizes: list[int], gen: torch.Generator, special: str
) -> list[torch.Tensor]:
    """Random CPU buffers: floats of magnitude [0.5, 2) with random signs (no zeros: the sign MIN/MAX
    picks between -0 and +0 is unspecified), scaled into the subnormals or holed with NaNs on
    request; integers small enough that products stay exact, large enough that sums are not."""
    bufs = []
    for i, size in enumerate(sizes):
        if dtype.is_floating_point:
            mag = torch.rand(size, generator=gen, dtype=torch.float64) * 1.5 + 0.5
            sign = torch.randint(0, 2, (size,), generator=gen) * 2 - 1
            values = mag * sign
            if special == "subnormal":
                values = values * torch.finfo(dtype).tiny / 4
            buf = values.to(dtype)
            if special == "nan" and i == 1:
                buf[torch.rand(size, generator=gen) < 0.3] = float("nan")
        else:
            bound = 6 if op == ReduceOp.PRODUCT else 2**20
            buf = torch.randint(-bound, bound, (size,), generator=gen, dtype=dtype)
        bufs.append(buf)
    return bufs


def reduce_into_last(
    kernels, bufs: list[torch.Tensor], offsets: list[int], n: int, dtype: torch.dtype, op: ReduceOp
) -> torch.Tensor:
    """Reduce the first k buffers into the last (poisoned first); returns the last buffer."""
    size = bufs[0].element_size()
    bufs[-1].fill_(poison_value(dtype))
    regions = [Region.of(b).sub(off * size, n * size) for b, off in zip(bufs, offsets)]
    kernels.reduce(regions[-1], regions[:-1], dtype, op, DIVISOR)
    return bufs[-1]
