"""copy and reduce of every kernel implementation that runs on CPU: torch, Triton under the
interpreter, and the CUDA C++ kernels built for the host (gpucomm.ops.cuda_emulate, 64 threads a
block, in this process: they need no variable set before an import).

The Triton kernels need TRITON_INTERPRET=1 set before triton is imported, which this pytest
process cannot promise (other test modules import triton too). So every Triton case runs in one
subprocess started with that variable (this file run as a script); it checks each case against
the float64 reference and bit for bit against TorchKernels on the same inputs, and reports one
verdict per case, which the parametrized tests below then assert.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from gpucomm.errors import UnsupportedError
from gpucomm.ops import SUPPORTED_DTYPES, Region, get_kernels
from gpucomm.ops.contract import Kernels
from gpucomm.ops.reference import TorchKernels
from gpucomm.reduce_op import ReduceOp, accumulation_dtype

IMPLS = ("torch", "triton", "cuda")
SIZES = (1, 7, 4099)
KS = (1, 2, 3, 5)
GUARD = 5  # poisoned elements after every region
DIVISOR = 3  # AVG's divisor: 1/3 is inexact in binary, so the division's rounding is exercised
_NAMES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int32: "i32",
    torch.int64: "i64",
}


def _poison(dtype: torch.dtype) -> float | int:
    return float("nan") if dtype.is_floating_point else -0x5A5A5A5A


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the elements, NaNs made canonical (their payloads may differ)."""
    if t.is_floating_point():
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    differ = (_bits(got) != _bits(want)).nonzero().flatten()
    if differ.numel():
        i = int(differ[0])
        raise AssertionError(
            f"{what}: {differ.numel()} element(s) differ from TorchKernels, first at {i}: "
            f"{got[i].item()!r} vs {want[i].item()!r}"
        )


# ----------------------------------------------------------------------------- reduce cases


@dataclass(frozen=True)
class ReduceCase:
    op: ReduceOp
    dtype: torch.dtype
    n: int
    k: int
    alias: int | None = None  # out is srcs[alias] itself
    aligned: bool = False  # every region 16-byte aligned (else odd element offsets)
    nan: bool = False  # srcs[k // 2] holds NaNs

    def __str__(self) -> str:
        extra = (f"-alias{self.alias}" if self.alias is not None else "") + ("-aligned" if self.aligned else "")
        return f"reduce-{self.op.name}-{_NAMES[self.dtype]}-n{self.n}-k{self.k}{extra}{'-nan' if self.nan else ''}"

    def offset(self, i: int) -> int:
        """Element offset of buffer i's region (i == k is out)."""
        if self.aligned:
            return 16 // torch.empty(0, dtype=self.dtype).element_size()
        return 2 * i + 1

    def inputs(self, gen: torch.Generator) -> list[torch.Tensor]:
        """k source buffers (region plus guards) with fresh random values, and the poisoned out buffer."""
        bufs = []
        for i in range(self.k + 1):
            size = self.offset(i) + self.n + GUARD
            if self.dtype.is_floating_point:
                # Magnitudes in [0.5, 2) with random signs: no zeros (the sign of a zero chosen
                # by MIN/MAX is not specified), no overflow of a product of five.
                mag = torch.rand(size, generator=gen, dtype=torch.float64) * 1.5 + 0.5
                sign = torch.randint(0, 2, (size,), generator=gen) * 2 - 1
                buf = (mag * sign).to(self.dtype)
                if self.nan and i == self.k // 2:
                    buf[torch.rand(size, generator=gen) < 0.3] = float("nan")
            else:
                bound = 6 if self.op == ReduceOp.PRODUCT else 1000  # products of five stay exact
                buf = torch.randint(-bound, bound, (size,), generator=gen, dtype=self.dtype)
            bufs.append(buf)
        bufs[self.k].fill_(_poison(self.dtype))
        return bufs

    def run(self, kernels: Kernels, bufs: list[torch.Tensor]) -> torch.Tensor:
        """Reduce into out (or into the aliased source); returns the buffer written."""
        size = bufs[0].element_size()
        regions = [Region.of(b).sub(self.offset(i) * size, self.n * size) for i, b in enumerate(bufs)]
        srcs, out = regions[: self.k], regions[self.k]
        if self.alias is not None:
            out = srcs[self.alias]
        kernels.reduce(out, srcs, self.dtype, self.op, DIVISOR)
        return bufs[self.alias if self.alias is not None else self.k]

    def reference(self, bufs: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The result in float64 (int64 for integers) from the untouched inputs, and the inputs widened."""
        wide = torch.float64 if self.dtype.is_floating_point else torch.int64
        xs = [b[self.offset(i) : self.offset(i) + self.n].to(wide) for i, b in enumerate(bufs[: self.k])]
        acc = xs[0]
        for x in xs[1:]:
            acc = {
                ReduceOp.PRODUCT: torch.mul,
                ReduceOp.MIN: torch.minimum,
                ReduceOp.MAX: torch.maximum,
            }.get(self.op, torch.add)(acc, x)
        if self.op == ReduceOp.AVG:
            acc = acc / DIVISOR if self.dtype.is_floating_point else torch.div(acc, DIVISOR, rounding_mode="trunc")
        return acc, xs

    def check(self, kernels: Kernels, oracle: Kernels | None, gen: torch.Generator) -> None:
        bufs = self.inputs(gen)
        want, xs = self.reference(bufs)
        before = [b.clone() for b in bufs]
        written = self.run(kernels, bufs)
        idx = self.alias if self.alias is not None else self.k
        lo = self.offset(idx)
        got = written[lo : lo + self.n]
        # Nothing outside the region was touched, and no source but an aliased out changed.
        for i, (b, b0) in enumerate(zip(bufs, before)):
            if i != idx:
                _assert_same_bits(b, b0, f"{self}: buffer {i} (not written)")
        _assert_same_bits(written[:lo], before[idx][:lo], f"{self}: guard before out")
        _assert_same_bits(written[lo + self.n :], before[idx][lo + self.n :], f"{self}: guard after out")
        self._check_values(got, want, xs)
        if oracle is not None:
            again = [b.clone() for b in before]
            _assert_same_bits(written, self.run(oracle, again), f"{self}: vs TorchKernels")

    def _check_values(self, got: torch.Tensor, want: torch.Tensor, xs: list[torch.Tensor]) -> None:
        if not self.dtype.is_floating_point:
            if not torch.equal(got.to(torch.int64), want):
                raise AssertionError(f"{self}: {got.tolist()[:8]} != reference {want.tolist()[:8]}")
            return
        got64 = got.to(torch.float64)
        if not torch.equal(torch.isnan(got64), torch.isnan(want)):
            raise AssertionError(f"{self}: NaN positions differ from the reference")
        if self.op in (ReduceOp.MIN, ReduceOp.MAX):
            bound = torch.zeros_like(want)  # picking an input is exact
        else:
            # Accumulation error (unit roundoff of the accumulation type per step) plus the one
            # final rounding to the output type.
            u_acc = torch.finfo(accumulation_dtype(self.dtype)).eps / 2
            u_out = torch.finfo(self.dtype).eps / 2
            if self.op == ReduceOp.PRODUCT:
                scale = want.abs() * self.k
            else:
                scale = sum(x.abs() for x in xs) * self.k / (DIVISOR if self.op == ReduceOp.AVG else 1)
            bound = u_acc * scale + u_out * want.abs() + torch.finfo(self.dtype).tiny
        finite = ~torch.isnan(want)
        err = (got64 - want).abs()
        if (err[finite] > bound[finite]).any():
            i = int(((err > bound) & finite).nonzero()[0])
            raise AssertionError(f"{self}: element {i} is {got64[i].item()!r}, reference {want[i].item()!r}")


REDUCE_CASES = [ReduceCase(op, dt, n, k) for op in ReduceOp for dt in SUPPORTED_DTYPES for n in SIZES for k in KS]
REDUCE_CASES += [ReduceCase(op, dt, 4099, 2, aligned=True) for op in ReduceOp for dt in SUPPORTED_DTYPES]
REDUCE_CASES += [ReduceCase(ReduceOp.SUM, dt, 7, 3, alias=a) for dt in SUPPORTED_DTYPES for a in (0, 2)]
REDUCE_CASES += [ReduceCase(op, torch.float32, 4099, 3, alias=1) for op in ReduceOp]
REDUCE_CASES += [
    ReduceCase(op, dt, 4099, 3, nan=True)
    for op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.SUM)
    for dt in SUPPORTED_DTYPES
    if dt.is_floating_point
]


# ------------------------------------------------------------------- rounding (exact) cases


@dataclass(frozen=True)
class RoundingCase:
    """Sums whose fp32 value is a tie (or just above one) in the 16-bit type: one rounding to
    nearest even gives ``want``; truncation or rounding after every step would not."""

    dtype: torch.dtype

    def __str__(self) -> str:
        return f"rounding-{_NAMES[self.dtype]}"

    def check(self, kernels: Kernels, oracle: Kernels | None, gen: torch.Generator) -> None:
        ulp = torch.finfo(self.dtype).eps  # spacing of the type just above 1.0
        # columns: tie to even (down), tie to even (up), above the tie only after the third term
        a = [1.0, 1.0 + ulp, 1.0]
        b = [ulp / 2, ulp / 2, ulp / 2]
        c = [0.0, 0.0, ulp / 256]
        want = torch.tensor([1.0, 1.0 + 2 * ulp, 1.0 + ulp], dtype=self.dtype)
        srcs = [torch.tensor(v, dtype=self.dtype) for v in (a, b, c)]
        out = torch.full((3,), float("nan"), dtype=self.dtype)
        kernels.reduce(Region.of(out), [Region.of(s) for s in srcs], self.dtype, ReduceOp.SUM)
        if not torch.equal(out, want):
            raise AssertionError(f"{self}: got {out.tolist()}, expected {want.tolist()}")


ROUNDING_CASES = [RoundingCase(torch.float16), RoundingCase(torch.bfloat16)]


# ------------------------------------------------------------------------------- copy cases


@dataclass(frozen=True)
class CopyCase:
    nbytes: int
    dst_offset: int
    src_offset: int

    def __str__(self) -> str:
        return f"copy-{self.nbytes}B-dst+{self.dst_offset}-src+{self.src_offset}"

    def check(self, kernels: Kernels, oracle: Kernels | None, gen: torch.Generator) -> None:
        size = max(self.dst_offset, self.src_offset) + self.nbytes + 16
        src = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
        dst = torch.full((size,), 0xA5, dtype=torch.uint8)
        before = dst.clone()
        kernels.copy(Region.of(dst).sub(self.dst_offset, self.nbytes), Region.of(src).sub(self.src_offset, self.nbytes))
        want = before.clone()
        want[self.dst_offset : self.dst_offset + self.nbytes] = src[self.src_offset : self.src_offset + self.nbytes]
        if not torch.equal(dst, want):
            bad = int((dst != want).nonzero()[0])
            raise AssertionError(f"{self}: byte {bad} is {int(dst[bad])}, expected {int(want[bad])}")


# Offsets pick every element width of the Triton copy (8, 4, 2, 1 bytes) and its aligned path.
COPY_CASES = [
    CopyCase(nbytes, dst, src)
    for nbytes in (0, 1, 7, 4099, 4099 * 8, 4096 * 8)
    for dst, src in ((0, 0), (16, 48), (8, 24), (4, 12), (2, 6), (3, 0), (1, 1))
]

ALL_CASES: dict[str, ReduceCase | RoundingCase | CopyCase] = {
    str(c): c for c in [*REDUCE_CASES, *ROUNDING_CASES, *COPY_CASES]
}


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _check(case, kernels: Kernels, oracle: Kernels | None) -> None:
    seed = _seed()
    try:
        case.check(kernels, oracle, torch.Generator().manual_seed(seed))
    except AssertionError as exc:
        raise AssertionError(f"{exc} (seed {seed})") from None


# ------------------------------------------------------------------ the interpreter worker


def _worker() -> dict[str, str]:
    """Every case on TritonKernels under the interpreter; '' for a pass, else the failure."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("test_cpu_kernels worker: run with TRITON_INTERPRET=1")
    triton_kernels = get_kernels("triton", torch.device("cpu"))
    verdicts = {"registry-auto-is-triton": "" if get_kernels("auto", "cpu") is triton_kernels else "auto != triton"}
    for name, case in ALL_CASES.items():
        try:
            _check(case, triton_kernels, TorchKernels())
            verdicts[name] = ""
        except AssertionError as exc:
            verdicts[name] = str(exc)
    return verdicts


@pytest.fixture(scope="module")
def triton_verdicts() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"interpreter worker failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run(impl: str, name: str, request: pytest.FixtureRequest) -> None:
    if impl == "torch":
        _check(ALL_CASES[name], TorchKernels(), None)
        return
    if impl == "cuda":
        from gpucomm.ops.cuda_emulate import EmulatedCudaKernels

        _check(ALL_CASES[name], EmulatedCudaKernels(threads=64), TorchKernels())
        return
    verdicts = request.getfixturevalue("triton_verdicts")
    if verdicts[name]:
        pytest.fail(verdicts[name], pytrace=False)


@pytest.mark.parametrize("case", [str(c) for c in REDUCE_CASES])
@pytest.mark.parametrize("impl", IMPLS)
def test_reduce(impl: str, case: str, request: pytest.FixtureRequest) -> None:
    _run(impl, case, request)


@pytest.mark.parametrize("case", [str(c) for c in ROUNDING_CASES])
@pytest.mark.parametrize("impl", IMPLS)
def test_reduce_rounds_once_to_nearest_even(impl: str, case: str, request: pytest.FixtureRequest) -> None:
    _run(impl, case, request)


@pytest.mark.parametrize("case", [str(c) for c in COPY_CASES])
@pytest.mark.parametrize("impl", IMPLS)
def test_copy(impl: str, case: str, request: pytest.FixtureRequest) -> None:
    _run(impl, case, request)


# ------------------------------------------------------- argument checks and the registry


def _f32(n: int) -> Region:
    return Region.of(torch.zeros(n, dtype=torch.float32))


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda k: k.copy(_f32(3), _f32(4)), ValueError, "same size"),
        (lambda k: k.reduce(_f32(3), [], torch.float32, ReduceOp.SUM), ValueError, "at least one"),
        (lambda k: k.reduce(_f32(3), [_f32(4)], torch.float32, ReduceOp.SUM), ValueError, "16 bytes"),
        (lambda k: k.reduce(_f32(3), [_f32(3)], torch.uint8, ReduceOp.SUM), TypeError, "dtype"),
        (lambda k: k.reduce(_f32(3), [_f32(3)], torch.float32, "sum"), TypeError, "ReduceOp"),
        (lambda k: k.reduce(_f32(3), [_f32(3)], torch.float32, ReduceOp.AVG, 0), ValueError, "divisor"),
        (lambda k: k.reduce(_f32(4).sub(1, 8), [_f32(2)], torch.float32, ReduceOp.SUM), ValueError, "aligned"),
        (lambda k: k.signal([_f32(4)], 1), ValueError, "one aligned int64"),
        (lambda k: k.signal([_f32(2)], -1), ValueError, "epoch"),
    ],
)
def test_bad_arguments_raise(call: Callable, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        call(TorchKernels())


def test_reduce_rejects_out_overlapping_a_source_at_another_offset() -> None:
    buf = Region.of(torch.zeros(8, dtype=torch.float32))
    with pytest.raises(ValueError, match="overlaps"):
        TorchKernels().reduce(buf.sub(0, 16), [buf.sub(4, 16)], torch.float32, ReduceOp.SUM)


def test_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert get_kernels("auto", cpu).name == "torch"
    assert get_kernels("torch", "cpu") is get_kernels("torch", cpu)
    with pytest.raises(UnsupportedError, match="TRITON_INTERPRET"):
        get_kernels("triton", cpu)
    with pytest.raises(UnsupportedError, match="CUDA"):
        get_kernels("cuda", cpu)
    with pytest.raises(ValueError, match="one of"):
        get_kernels("nccl", cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
@pytest.mark.parametrize("name", ["auto", "triton", "cuda", "torch"])
def test_registry_without_cuda_raises_unsupported(name: str) -> None:
    with pytest.raises(UnsupportedError, match="CUDA"):
        get_kernels(name, "cuda")


def test_registry_auto_is_triton_under_the_interpreter(request: pytest.FixtureRequest) -> None:
    _run("triton", "registry-auto-is-triton", request)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    print(json.dumps(_worker()))
