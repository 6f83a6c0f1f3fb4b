"""A REDUCE that stores into a second destination (``Builder.reduce(also=...)``: STORE_ALSO) and
carries one or two COPYs (``carry=``: COPYs flagged CARRIED, run inside the fold's loop), built by
the real Builder and run by one family's program kernel in one process
(:class:`program_workspace.Workspace`), checked bit for bit against TorchKernels on CPU run the way
the host executor runs such a program: the fold, then the second store, then each carried copy alone,
in order.

The layout is a two-shot's, on 3 ranks: slice 1 of every rank's read half is folded (into this
rank's write half and, with ``also``, into the caller's output as well; without it, into the output
alone), while the caller's input slices 0 and 2 are copied into this rank's write half (the
copy-in a pipelined two-shot carries beside its fold). Every destination is poisoned first, and
every byte of it is checked, guards and the bytes between the slices included; the sources are
checked unchanged.

Sizes count in iterations of the CUDA C++ fold's vector body (``VECTORS_PER_SOURCE`` 16-byte
vectors per source and thread, kernels/cuda/common.cuh): ``body`` gives each channel about three
of them (so a carried copy is cut into several shares, one per iteration) and ends one element into
a 16-byte vector; ``small`` is 37 elements, less than one iteration. ``threads`` is the block size
of the kernels' build (512 on a GPU, 64 where the tests build them for the host).

Shared by tests/gpu/test_program_kernels.py (CUDA tensors) and tests/ops/test_carried_programs.py
(CPU: Triton's interpreter and the CUDA C++ kernels built for the host), so the same code builds and
checks every case on both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from program_workspace import Workspace
from reduce_bits import DIVISOR, GUARD, poison_value, random_buffers

from gpucomm.ops.contract import Region
from gpucomm.ops.program import CARRIED, COPY, REDUCE
from gpucomm.ops.reference import TorchKernels
from gpucomm.reduce_op import ReduceOp

__all__ = ["CASES", "Case", "VECTORS_PER_SOURCE", "body_bytes", "run_case"]

# kernels/cuda/common.cuh's VECTORS_PER_SOURCE (tests/ops/test_carried_programs.py reads it there).
VECTORS_PER_SOURCE = 2
WORLD = 3  # rank 1 of a 3-rank two-shot carries two ranges: the slices before its own and after
_POISON_BYTE = 0xA5
_SMALL = 37


class Case(NamedTuple):
    dtype: torch.dtype
    op: ReduceOp
    size: str  # "body" or "small" (module docstring)
    aligned: bool  # every address and in-half position on 16 bytes, else one element off
    also: bool  # the fold stores into the write half and into the output (STORE_ALSO)
    carried: int  # COPYs the REDUCE carries: 0, 1 (slice 0) or 2 (slices 0 and 2)
    channels: int


_SHAPES = [
    (torch.float32, ReduceOp.SUM, "body", True, True, 2),
    (torch.bfloat16, ReduceOp.AVG, "body", False, True, 2),
    (torch.float16, ReduceOp.MAX, "small", True, True, 1),
    (torch.float64, ReduceOp.PRODUCT, "body", True, False, 1),
    (torch.int32, ReduceOp.MIN, "small", False, True, 0),
    (torch.int64, ReduceOp.SUM, "body", True, True, 0),
    (torch.float32, ReduceOp.AVG, "small", False, False, 2),
    (torch.float16, ReduceOp.SUM, "body", False, True, 1),
]
CASES = {
    f"{str(d).split('.')[-1]}-{op.name}-{size}-{'aligned' if al else 'odd'}-{'also' if also else 'noalso'}"
    f"-carry{c}-ch{ch}": Case(d, op, size, al, also, c, ch)
    for d, op, size, al, also, c in _SHAPES
    for ch in (1, 3)
}


def body_bytes(threads: int) -> int:
    """Bytes one iteration of the CUDA C++ fold's vector body covers per source, at ``threads`` a block."""
    return VECTORS_PER_SOURCE * 16 * threads


def _elements(case: Case, threads: int) -> int:
    elem = torch.empty(0, dtype=case.dtype).element_size()
    if case.size == "small":
        return _SMALL
    # The granule is about a slice over the channels (gpucomm.workspace.channels.granule), so a
    # channel owns about one slice / channels of the fold: three iterations each, then one element.
    return 3 * case.channels * body_bytes(threads) // elem + 1


def _layout(case: Case, n: int, elem: int) -> tuple[list[int], int]:
    """In-half positions of the 3 slices (the caller's input has its slices as far apart), and the
    half's bytes."""
    nbytes = n * elem
    if case.aligned:
        base, stride = 0, -(-nbytes // 16) * 16
    else:
        base, stride = elem, nbytes + (elem if nbytes % 16 == 0 else 0)
    pos = [base + j * stride for j in range(WORLD)]
    return pos, -(-(pos[-1] + nbytes + 64) // 4096) * 4096


def _first_difference(got: torch.Tensor, want: torch.Tensor, regions: dict[str, tuple[int, int]]) -> str:
    """'' if the bytes are equal, else the count and the first differing byte, named by its region."""
    differ = (got != want).nonzero().flatten()
    if not differ.numel():
        return ""
    i = int(differ[0])
    where = next((f"{name} +{i - lo}" for name, (lo, hi) in regions.items() if lo <= i < hi), "outside every region")
    return f"{differ.numel()} byte(s) differ, first at {i} ({where}): {int(got[i]):#x} vs {int(want[i]):#x}"


def run_case(kernels, device: torch.device, case: Case, seed: int, threads: int) -> str:
    """Run ``case`` on ``kernels`` (rank 0 of a workspace on ``device``); '' if every byte is the
    oracle's, else what differs."""
    gen = torch.Generator().manual_seed(seed)
    elem = torch.empty(0, dtype=case.dtype).element_size()
    n = _elements(case, threads)
    nbytes = n * elem
    pos, half_bytes = _layout(case, n, elem)
    at = [(p - pos[0]) // elem for p in pos]  # where the input's slices start, in elements after its first
    skew = 16 // elem if case.aligned else 1  # the tensors' first element in their storage

    # Every rank's read half: random bytes, with this case's sources in slice 1.
    slices = random_buffers(case.dtype, case.op, [n] * WORLD, gen, special="")
    reads = [torch.randint(0, 256, (half_bytes,), generator=gen, dtype=torch.uint8) for _ in range(WORLD)]
    for p, s in enumerate(slices):
        reads[p][pos[1] : pos[1] + nbytes] = s.view(torch.uint8)
    inp = random_buffers(case.dtype, case.op, [skew + at[-1] + n + GUARD], gen, special="")[0]
    out = torch.full((skew + n + GUARD,), poison_value(case.dtype), dtype=case.dtype)

    # The oracle: TorchKernels' fold, the second store, then the carried copies, one after the other.
    result = torch.full((n,), poison_value(case.dtype), dtype=case.dtype)
    TorchKernels().reduce(Region.of(result), [Region.of(s) for s in slices], case.dtype, case.op, DIVISOR)
    want_write = torch.full((half_bytes,), _POISON_BYTE, dtype=torch.uint8)
    want_out = out.clone()
    want_out[skew : skew + n] = result
    if case.also:
        want_write[pos[1] : pos[1] + nbytes] = result.view(torch.uint8)
    carried = [0, 2][: case.carried]
    for j in carried:
        want_write[pos[j] : pos[j] + nbytes] = inp[skew + at[j] : skew + at[j] + n].view(torch.uint8)

    ws = Workspace(device, WORLD, case.channels, half_bytes)
    for p in range(WORLD):
        ws.half(p, 1).copy_(reads[p])  # round -1 (the read half at epoch 0) is half 1
        ws.half(p, 0).fill_(_POISON_BYTE)
    dev_inp, dev_out = inp.to(device, copy=True), out.to(device, copy=True)  # copies on CPU too: inp stays the oracle's

    b = ws.builder("carried")
    read, write = b.read_offset(), b.write_offset()
    srcs = [b.slot(p, read + pos[1], nbytes) for p in range(WORLD)]
    caller_out = Region.of(dev_out).sub(skew * elem, nbytes)
    fold_out, also = (b.slot(0, write + pos[1], nbytes), caller_out) if case.also else (caller_out, None)
    carry = [
        (b.slot(0, write + pos[j], nbytes), Region.of(dev_inp).sub((skew + at[j]) * elem, nbytes)) for j in carried
    ]
    b.reduce(fold_out, srcs, case.dtype, case.op, DIVISOR, also=also, carry=carry)
    program = b.finish()
    problems = _program_problems(program, case)
    if program.aligned() != case.aligned:
        problems.append(f"the program is {'' if program.aligned() else 'not '}aligned")
    if problems:  # the builder did not record what this case is about: nothing to run
        return "; ".join(problems)

    ws.run(kernels, program)
    regions = {f"slice {j}": (pos[j], pos[j] + nbytes) for j in range(WORLD)}
    result_bytes = {"the result": (skew * elem, skew * elem + nbytes)}
    checks = [
        ("this rank's write half", ws.half(0, 0).cpu(), want_write, regions),
        ("the output's storage", dev_out.cpu().view(torch.uint8), want_out.view(torch.uint8), result_bytes),
        ("the input's storage (a source)", dev_inp.cpu().view(torch.uint8), inp.view(torch.uint8), {}),
    ]
    checks += [(f"rank {p}'s read half (a source)", ws.half(p, 1).cpu(), reads[p], regions) for p in range(WORLD)]
    untouched = torch.full_like(want_write, _POISON_BYTE)  # nothing writes the other ranks' write halves
    checks += [(f"rank {p}'s write half", ws.half(p, 0).cpu(), untouched, regions) for p in range(1, WORLD)]
    for name, got, want, named in checks:
        if found := _first_difference(got, want, named):
            problems.append(f"{name}: {found}")
    if ws.epochs() != [0] * case.channels or ws.poisoned() or any(r[0] for r in ws.records()):
        problems.append(f"state {ws.epochs()} poisoned={ws.poisoned()} records={ws.records()}")
    return "; ".join(problems)


def _program_problems(program, case: Case) -> list[str]:
    """What the recorded instructions lack of the case: a REDUCE with a second destination where
    ``also``, followed by exactly ``carried`` COPYs flagged CARRIED."""
    kinds = [(ins[0], len(ins)) for ins in program.instructions]
    want = [(REDUCE, 8 if case.also else 7)] + [(COPY, 6)] * case.carried
    problems = [] if kinds == want else [f"instructions {kinds}, expected {want}"]
    if any(ins[0] == COPY and ins[5] != CARRIED for ins in program.instructions):
        problems.append("a COPY not flagged CARRIED")
    return problems
