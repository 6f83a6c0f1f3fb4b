"""Every dtype gpucomm moves beyond the six native ones, through every collective, on one rank.

Run inside spawned ranks after ``gpucomm.init_process_group``. Each rank draws every rank's
input (seeded by seed, case and rank), so it builds the reference of the whole group itself:
data movement must be bit-exact; reductions must match the semantics documented in
gpucomm/comm/dtypes.py, computed here independently (exact integers in int64 or Python ints,
float8 folded in fp32 in rank order, bool with any/all, complex in complex128).
"""

from __future__ import annotations

import torch

import gpucomm as dist
from gpucomm.comm.dtypes import MOVABLE, NATIVE, REDUCIBLE
from gpucomm.reduce_op import ReduceOp

NEW_MOVABLE = tuple(d for d in MOVABLE if d not in NATIVE)
NEW_REDUCIBLE = tuple(d for d in REDUCIBLE if d not in NATIVE)
OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)
N = 37  # odd, not a multiple of any vector width
_INT_RANGE = {  # (low, high) of the inputs: wide enough that SUM and PRODUCT wrap around
    torch.int8: (-100, 100),
    torch.uint8: (0, 250),
    torch.int16: (-30000, 30000),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``: compares NaNs, signed zeros and float8 exactly."""
    return t.contiguous().reshape(-1).unsqueeze(-1).view(torch.uint8).reshape(-1)


def make(seed: int, case: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s input of ``case``: the same on every rank that draws it (seeded by all three)."""
    gen = torch.Generator().manual_seed(seed * 7919 + case * 131 + rank)
    if dtype not in REDUCIBLE:  # move-only formats (float4 has no arithmetic at all): raw bytes
        return (
            torch.randint(0, 256, (n, torch.empty(0, dtype=dtype).element_size()), generator=gen, dtype=torch.uint8)
            .view(dtype)
            .reshape(n)
        )
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=gen).bool()
    if dtype.is_complex:
        # small integer parts, times 6: sums and averages over 2 or 3 ranks are exact
        parts = torch.randint(-4, 5, (n, 2), generator=gen).to(torch.float64) * 6
        return torch.view_as_complex(parts).to(dtype)
    if dtype.is_floating_point:  # float8: random bytes that are finite values of the format
        values = torch.randint(-12, 13, (n,), generator=gen).to(torch.float32) / 4
        return values.to(dtype)
    if dtype in _INT_RANGE:
        low, high = _INT_RANGE[dtype]
        return torch.randint(low, high + 1, (n,), generator=gen).to(dtype)
    if dtype == getattr(torch, "uint64", None):
        # both halves of the unsigned range, so MIN and MAX must compare unsigned
        return torch.tensor([int(v) for v in torch.randint(0, 1 << 62, (n,), generator=gen)], dtype=torch.uint64) * 3
    high = 60000 if dtype == getattr(torch, "uint16", None) else 4_000_000_000
    return torch.tensor(torch.randint(0, high, (n,), generator=gen).tolist(), dtype=dtype)


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """A copy through the bytes (float4 has no copy kernel)."""
    return bits(t).clone().view(t.dtype).reshape(t.shape)


def reference(inputs: list[torch.Tensor], op: ReduceOp, dtype: torch.dtype) -> torch.Tensor | None:
    """The documented result, or None where gpucomm refuses the op on this dtype."""
    P = len(inputs)
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        if op is ReduceOp.AVG:
            return None
        return stack.any(0) if op in (ReduceOp.SUM, ReduceOp.MAX) else stack.all(0)
    if dtype.is_complex:
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            return None
        total = torch.stack([t.to(torch.complex128) for t in inputs]).sum(0)
        return (total / P if op is ReduceOp.AVG else total).to(dtype)
    if dtype.is_floating_point:  # float8: fold in fp32, in rank order, round once
        acc = inputs[0].to(torch.float32)
        for t in inputs[1:]:
            t = t.to(torch.float32)
            acc = {
                ReduceOp.PRODUCT: acc * t,
                ReduceOp.MIN: torch.minimum(acc, t),
                ReduceOp.MAX: torch.maximum(acc, t),
            }.get(op, acc + t)
        return (acc / P if op is ReduceOp.AVG else acc).to(dtype)
    # integers: exact values in Python, then wrapped into the dtype
    rows = list(zip(*[t.tolist() for t in inputs]))
    if dtype == getattr(torch, "uint64", None) and op is ReduceOp.AVG:
        return None
    if op is ReduceOp.SUM:
        exact = [sum(r) for r in rows]
    elif op is ReduceOp.PRODUCT:
        exact = [_prod(r) for r in rows]
    elif op is ReduceOp.MIN:
        exact = [min(r) for r in rows]
    elif op is ReduceOp.MAX:
        exact = [max(r) for r in rows]
    else:
        exact = [int(sum(r) / P) for r in rows]  # truncates towards zero (sums are small)
    bits_ = torch.iinfo(dtype).bits
    signed = torch.iinfo(dtype).min < 0
    wrapped = [_wrap(v, bits_, signed) for v in exact]
    return torch.tensor(wrapped, dtype=dtype)


def _prod(values: tuple[int, ...]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _wrap(value: int, nbits: int, signed: bool) -> int:
    value %= 1 << nbits
    return value - (1 << nbits) if signed and value >= 1 << (nbits - 1) else value


class DtypeMatrix:
    """Runs every case on this rank (in the same order on every rank), collecting failures."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rank = dist.get_rank()
        self.P = dist.get_world_size()
        self.case = 0
        self.failures: list[str] = []
        self.checked = 0

    def inputs(self, dtype: torch.dtype, n: int = N) -> list[torch.Tensor]:
        self.case += 1
        return [make(self.seed, self.case, r, n, dtype) for r in range(self.P)]

    def expect(self, ok: bool, what: str) -> None:
        self.checked += 1
        if not ok:
            self.failures.append(f"rank {self.rank}: {what}")

    def same(self, got: torch.Tensor | list[torch.Tensor], want: torch.Tensor | list[torch.Tensor], what: str) -> None:
        """Bitwise equal (lists compare as their concatenation: float4 has no torch.cat)."""
        got, want = (got if isinstance(got, list) else [got]), (want if isinstance(want, list) else [want])
        same_dtype = all(t.dtype == want[0].dtype for t in got + want)
        self.expect(
            same_dtype and torch.equal(torch.cat([bits(t) for t in got]), torch.cat([bits(t) for t in want])), what
        )

    def movement(self, dtype: torch.dtype) -> None:
        P, me = self.P, self.rank
        ins = self.inputs(dtype)
        root = self.case % P
        t = copy_of(ins[me])
        dist.broadcast(t, src=root)
        self.same(t, ins[root], f"broadcast {dtype}")
        outs = [torch.empty(N, dtype=dtype) for _ in range(P)]
        dist.all_gather(outs, ins[me])
        self.same(outs, ins, f"all_gather {dtype}")
        flat = torch.empty(P * N, dtype=dtype)
        dist.all_gather_into_tensor(flat, ins[me])
        self.same(flat, ins, f"all_gather_into_tensor {dtype}")
        gathered = [torch.empty(N, dtype=dtype) for _ in range(P)] if me == root else None
        dist.gather(ins[me], gathered, dst=root)
        if gathered is not None:
            self.same(gathered, ins, f"gather {dtype}")
        pieces = self.inputs(dtype, P * 5)
        out = torch.empty(5, dtype=dtype)
        dist.scatter(out, list(pieces[root].split(5)) if me == root else None, src=root)
        self.same(out, pieces[root][me * 5 : (me + 1) * 5], f"scatter {dtype}")
        # all_to_all with uneven pieces: rank r sends r + j + 1 elements to rank j
        sent = [self.inputs(dtype, r + j + 1) for r in range(P) for j in range(P)]  # same draws on every rank
        mine = [sent[me * P + j][me] for j in range(P)]
        got = [torch.empty(j + me + 1, dtype=dtype) for j in range(P)]
        dist.all_to_all(got, mine)
        self.same(got, [sent[j * P + me][j] for j in range(P)], f"all_to_all {dtype}")
        rows = self.inputs(dtype, P * 6)
        square = rows[me].reshape(P * 3, 2)  # 2-d: split sizes count rows of 2
        out2 = torch.empty(P * 3, 2, dtype=dtype)
        dist.all_to_all_single(out2, square)
        self.same(
            out2, [rows[j].reshape(P * 3, 2)[me * 3 : (me + 1) * 3] for j in range(P)], f"all_to_all_single {dtype}"
        )
        if P > 1:
            ring = self.inputs(dtype)
            recv = torch.empty(N, dtype=dtype)
            work = dist.isend(ring[me], dst=(me + 1) % P)
            dist.recv(recv, src=(me - 1) % P)
            work.wait()
            self.same(recv, ring[(me - 1) % P], f"isend/recv ring {dtype}")

    def reductions(self, dtype: torch.dtype) -> None:
        P, me = self.P, self.rank
        for op in OPS:
            ins = self.inputs(dtype)
            want = reference(ins, op, dtype)
            if want is None:
                try:
                    dist.all_reduce(ins[me].clone(), op=op)
                except TypeError as err:
                    self.expect(
                        f"gpucomm.all_reduce: ReduceOp.{op.name} is not defined on {dtype}" in str(err),
                        f"all_reduce {dtype} {op.name}: {err}",
                    )
                else:
                    self.expect(False, f"all_reduce {dtype} {op.name}: expected a TypeError")
                continue
            t = ins[me].clone()
            dist.all_reduce(t, op=op)
            self.same(t, want, f"all_reduce {dtype} {op.name}")
            root = self.case % P
            t = ins[me].clone()
            dist.reduce(t, dst=root, op=op)
            self.same(t, want if me == root else ins[me], f"reduce {dtype} {op.name} root={root}")
            full = self.inputs(dtype, P * N)
            chunks = [f[me * N : (me + 1) * N] for f in full]
            out = torch.empty(N, dtype=dtype)
            dist.reduce_scatter_tensor(out, full[me], op=op)
            self.same(out, reference(chunks, op, dtype), f"reduce_scatter_tensor {dtype} {op.name}")
            out = torch.empty(N, dtype=dtype)
            dist.reduce_scatter(out, list(full[me].split(N)), op=op)
            self.same(out, reference(chunks, op, dtype), f"reduce_scatter {dtype} {op.name}")


def run_dtype_matrix(seed: int) -> tuple[list[str], int]:
    """Every new dtype through every collective; returns (failures, number of checks)."""
    m = DtypeMatrix(seed)
    for dtype in NEW_MOVABLE:
        m.movement(dtype)
    for dtype in NEW_REDUCIBLE:
        m.reductions(dtype)
    for dtype in (d for d in NEW_MOVABLE if d not in NEW_REDUCIBLE):
        try:
            dist.all_reduce(torch.zeros(3, dtype=dtype))
        except TypeError as err:
            m.expect("gpucomm.all_reduce: ReduceOp.SUM is not defined on" in str(err), f"{dtype}: {err}")
        else:
            m.expect(False, f"all_reduce {dtype}: expected a TypeError")
    return m.failures, m.checked
