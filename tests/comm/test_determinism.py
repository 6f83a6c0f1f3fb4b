"""Deterministic reductions by contract (docs/algorithms.md, "Deterministic reductions").

Every result must be bitwise equal to a reference that folds the ranks' inputs in rank order in
the accumulation type (fp32 for fp32, bf16, fp16 and fp8, which gpucomm.comm.dtypes stages in fp32),
divides once for AVG and rounds once: not a float64 reference, which rounds differently. The
inputs span a wide dynamic range, so a fold in any other order gives other bits in many
elements (ring: 6.1% of 1 Mi fp32 elements at 4 ranks, docs/results/2026-11-23-determinism).

One spawned job per world size runs the whole matrix (the ranks loop over kernels, channels,
algorithms, dtypes, ops and sizes), so that CI pays for one rendezvous of processes per world
size. A small workspace (halves of 24 KiB) makes the large messages pipeline through many pieces
cheaply; the Triton interpreter, which is slow, gets the small sizes only (a few pieces still).
"""

from __future__ import annotations

import random

import pytest
from spawn import run_ranks

WORKSPACE = "64K"  # a quarter for mailboxes, two 24 KiB halves: 1 Mi fp32 elements take 171 pieces
SMALL = (1, 7, 4099)  # one element, a 16-byte-unaligned size, a few pieces of a half
MEDIUM = 65537  # 256 KiB of fp32: two-shot under auto, 11 pieces
LARGE = (1 << 20) + 3  # several MiB (4 MiB of fp32), 171 pieces one-shot, 44 two-shot
PREFIX = 4099  # reduced alone (one-shot under auto) and as the head of LARGE (two-shot under auto)
PREMUL = 0.3  # PREMUL_SUM's factor: not a power of two, so the premultiplication rounds

# Exponent ranges of the inputs, as wide as each dtype allows without the sum of 8 ranks
# overflowing (fp16 max 65504, e4m3fn max 448).
_EXPONENTS = {"float32": (-40, 40), "bfloat16": (-40, 40), "float16": (-12, 11), "float8_e4m3fn": (-6, 4)}
DTYPES = tuple(_EXPONENTS)
OPS = ("SUM", "AVG", "PREMUL_SUM")


def wide(seed: int, case: int, rank: int, n: int, dtype_name: str):
    """``n`` values of random sign, mantissa and exponent over the dtype's range."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + case * 1009 + rank)
    lo, hi = _EXPONENTS[dtype_name]
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
    mantissa = 1 + torch.rand(n, generator=gen, dtype=torch.float64)
    exponent = torch.randint(lo, hi + 1, (n,), generator=gen).to(torch.float64)
    return (sign * mantissa * torch.exp2(exponent)).to(getattr(torch, dtype_name))


def rank_order_reference(inputs: list, op: str, groups: list[list[int]] | None = None):
    """The contract's result: premultiply (PREMUL_SUM, in the dtype; fp8 in fp32), fold in rank
    order in the accumulation type, AVG divides once by the number of ranks, one rounding.
    ``groups``: the nodes of a hierarchical layout (each folded in rank order, then the nodes
    in node order), None for one node."""
    import torch

    dtype = inputs[0].dtype
    acc = torch.float32  # the accumulation type of every dtype this matrix runs
    if op == "PREMUL_SUM":
        inputs = [(x.to(torch.float32) if x.element_size() == 1 else x) * PREMUL for x in inputs]

    def fold(xs: list) -> torch.Tensor:
        total = xs[0].to(acc)
        for x in xs[1:]:
            total = total + x.to(acc)
        return total

    total = fold(inputs) if groups is None else fold([fold([inputs[r] for r in g]) for g in groups])
    if op == "AVG":
        total = total / len(inputs)
    return total.to(dtype)


def _bits(t):
    import torch

    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


class Checker:
    """Runs reducing calls on this rank and records every element that is not the reference."""

    def __init__(self, rank: int, world_size: int, seed: int) -> None:
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.case = 0
        self.failures: list[str] = []
        self.calls = 0

    def inputs(self, n: int, dtype: str) -> list:
        self.case += 1
        return [wide(self.seed, self.case, r, n, dtype) for r in range(self.world_size)]

    def expect(self, label: str, out, ref) -> None:
        self.calls += 1
        differ = int((_bits(out) != _bits(ref)).sum())
        if differ:
            self.failures.append(
                f"rank {self.rank}: {label}: {differ} of {ref.numel()} elements differ from the rank-order fold"
            )

    @staticmethod
    def op(name: str):
        import gpucomm

        return gpucomm.ReduceOp.PREMUL_SUM(PREMUL) if name == "PREMUL_SUM" else getattr(gpucomm.ReduceOp, name)

    def all_reduce(self, label: str, n: int, dtype: str, op: str, groups: list[list[int]] | None = None) -> None:
        import gpucomm

        xs = self.inputs(n, dtype)
        t = xs[self.rank].clone()
        gpucomm.all_reduce(t, op=self.op(op))
        self.expect(f"{label} all_reduce n={n} {dtype} {op}", t, rank_order_reference(xs, op, groups))

    def prefix(self, label: str, dtype: str, op: str) -> None:
        """A prefix reduced alone must have the bits of the same prefix of a large message."""
        import gpucomm

        xs = self.inputs(LARGE, dtype)
        ref = rank_order_reference(xs, op)
        head = xs[self.rank][:PREFIX].clone()
        whole = xs[self.rank].clone()
        gpucomm.all_reduce(head, op=self.op(op))
        gpucomm.all_reduce(whole, op=self.op(op))
        self.expect(f"{label} all_reduce n={LARGE} {dtype} {op}", whole, ref)
        self.expect(f"{label} prefix of {PREFIX} alone {dtype} {op}", head, ref[:PREFIX])
        if not bool((_bits(head) == _bits(whole[:PREFIX])).all()):
            self.failures.append(
                f"rank {self.rank}: {label}: the first {PREFIX} elements reduced alone differ from the same elements "
                f"of {LARGE}"
            )

    def reduce(self, label: str, n: int, dtype: str, op: str) -> None:
        import gpucomm

        xs = self.inputs(n, dtype)
        root = self.case % self.world_size
        t = xs[self.rank].clone()
        gpucomm.reduce(t, dst=root, op=self.op(op))
        if self.rank == root:
            self.expect(f"{label} reduce root={root} n={n} {dtype} {op}", t, rank_order_reference(xs, op))

    def reduce_scatter(self, label: str, n: int, dtype: str, op: str) -> None:
        """Both forms; rank r's output must be chunk r of all_reduce's result."""
        import torch

        import gpucomm

        P, me = self.world_size, self.rank
        xs = self.inputs(n * P, dtype)
        ref = rank_order_reference(xs, op)[me * n : (me + 1) * n]
        out = torch.empty(n, dtype=xs[0].dtype)
        gpucomm.reduce_scatter_tensor(out, xs[me].clone(), op=self.op(op))
        self.expect(f"{label} reduce_scatter_tensor n={n} {dtype} {op}", out, ref)
        out = torch.empty(n, dtype=xs[0].dtype)
        gpucomm.reduce_scatter(out, list(xs[me].clone().chunk(P)), op=self.op(op))
        self.expect(f"{label} reduce_scatter n={n} {dtype} {op}", out, ref)


def _session(knobs: dict, expect_kernels: str):
    import gpucomm

    gpucomm.init_process_group(transport="shm", workspace_bytes=WORKSPACE, timeout=120, **knobs)
    paths = gpucomm.get_default_communicator().paths()
    if f"kernels={expect_kernels}" not in paths.get("cpu", ""):
        raise AssertionError(f"{knobs}: CPU tensors are served by {paths}, not the {expect_kernels} kernels")


def _matrix(rank: int, world_size: int, seed: int, hierarchical: bool) -> tuple[list[str], int]:
    import warnings

    import gpucomm

    warnings.filterwarnings("error", message="gpucomm")  # no call of this matrix may leave the contract
    c = Checker(rank, world_size, seed)
    # The torch kernels: every algorithm that keeps the contract, and auto, at every size.
    for algo in ("auto", "oneshot", "twoshot"):
        _session({"kernels": "torch", "algo": algo}, "torch")
        for i, dtype in enumerate(DTYPES):
            for op in OPS:
                for n in SMALL:
                    c.all_reduce(f"torch {algo}", n, dtype, op)
            if algo == "auto" or world_size <= 4:  # 8 ranks: the CI budget; auto is two-shot here
                c.all_reduce(f"torch {algo}", MEDIUM, dtype, OPS[(i + len(algo)) % len(OPS)])
        if algo == "auto":
            # auto reduces the prefix one-shot and the whole two-shot. At 8 ranks on the
            # 2-core CI machine the large case costs the most: fp32 and bf16 only there.
            for i, dtype in enumerate(DTYPES):
                if world_size <= 4 or dtype in ("float32", "bfloat16"):
                    c.prefix("torch auto", dtype, OPS[i % 2])
            # reduce and reduce_scatter: direct is their only contract keeper, auto picks it.
            for i, dtype in enumerate(DTYPES):
                for op in OPS:
                    for n in (7, 4099):
                        c.reduce("torch auto", n, dtype, op)
                        c.reduce_scatter("torch auto", n, dtype, op)
                c.reduce("torch auto", MEDIUM, dtype, OPS[i % len(OPS)])
                c.reduce_scatter("torch auto", MEDIUM // world_size, dtype, OPS[(i + 1) % len(OPS)])
        gpucomm.destroy_process_group()
    # The Triton program kernel under the interpreter (slow: a few calls each), 1 to 3
    # channels, both all_reduce algorithms; every dtype on every channel count, the ops in turn.
    for channels in (1, 2, 3):
        # 8 ranks (the CI budget): one algorithm per channel count, in turn.
        algos = ("oneshot", "twoshot") if world_size <= 4 else (("oneshot", "twoshot")[channels % 2],)
        for algo in algos:
            a = ("oneshot", "twoshot").index(algo)
            _session({"kernels": "triton", "algo": algo, "channels": channels}, "triton")
            for i, dtype in enumerate(DTYPES):
                n = (7, 4099)[(i + a) % 2]
                c.all_reduce(f"triton channels={channels} {algo}", n, dtype, OPS[(i + channels + a) % len(OPS)])
            gpucomm.destroy_process_group()
    _session({"kernels": "triton", "algo": "auto", "channels": 2}, "triton")
    for i, dtype in enumerate(DTYPES):
        c.reduce("triton channels=2 auto", 4099, dtype, OPS[i % len(OPS)])
        c.reduce_scatter("triton channels=2 auto", 1031, dtype, OPS[(i + 1) % len(OPS)])
    gpucomm.destroy_process_group()
    # Ring and tree (forced) fold in another order, and the matrix must see it. Not where their
    # fp32 order is rank order's: at 2 ranks x1 + x0 (IEEE addition commutes), and tree at 3
    # ranks (the root folds x0, x1, x2, its two leaves).
    for algo in [a for a, smallest in (("ring", 3), ("tree", 4)) if world_size >= smallest]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _session({"kernels": "torch", "algo": algo}, "torch")
            before = len(c.failures)
            c.all_reduce(f"forced {algo}", MEDIUM, "float32", "SUM")
            gpucomm.destroy_process_group()
        if len(c.failures) == before:
            c.failures.append(
                f"rank {rank}: a forced {algo} all_reduce matched the rank-order fold: the matrix cannot tell orders "
                "apart"
            )
        else:
            c.failures.pop()
        if not any(f"forces {algo}" in str(w.message) for w in caught):
            c.failures.append(f"rank {rank}: forcing {algo} did not warn")
    if hierarchical:  # two pretended nodes of two ranks: the stated two-level order
        nodes = [[0, 1], [2, 3]]
        _session({"kernels": "torch", "local_world_size": 2}, "torch")
        for dtype in DTYPES:
            for op in OPS:
                for n in (*SMALL, MEDIUM):
                    c.all_reduce("hierarchical 2x2", n, dtype, op, groups=nodes)
        gpucomm.destroy_process_group()
    return c.failures, c.calls


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_every_reduction_folds_in_rank_order(world_size: int) -> None:
    seed = random.randrange(1 << 30)
    hierarchical = world_size == 4
    results = run_ranks(_matrix, world_size, seed, hierarchical, env={"TRITON_INTERPRET": "1"}, timeout=900)
    failures = [f for fails, _ in results for f in fails]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:40])
    assert all(calls > 0 for _, calls in results)


def test_the_reference_is_not_float64() -> None:
    """The matrix's reference rounds as a rank-order fp32 fold does, which a float64 sum does
    not reproduce on these inputs (so the matrix really checks the order, not closeness)."""
    import torch

    xs = [wide(7, 1, r, 4099, "float32") for r in range(4)]
    ref = rank_order_reference(xs, "SUM")
    exact = torch.stack([x.to(torch.float64) for x in xs]).sum(0).to(torch.float32)
    reordered = rank_order_reference(xs[::-1], "SUM")
    assert not torch.equal(ref, exact)
    assert not torch.equal(ref, reordered)
