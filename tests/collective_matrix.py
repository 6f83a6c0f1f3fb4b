"""Every primitive × op × dtype × size on one rank, checked against float64 references.

Run inside spawned ranks after ``gpucomm.init_process_group``. Each rank draws every rank's
input from a generator seeded by (seed, case, rank), so it can build the reference for the
whole group on its own. Outputs are poisoned before each call. A rank returns its failures and
a digest of every output that must be identical on all ranks; the test compares digests.
"""

from __future__ import annotations

import hashlib
import torch

import gpucomm as dist
from gpucomm.reduce_op import ReduceOp

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64)
OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)
SIZES = (0, 1, 7, 4099)

_EPS = {
    torch.float16: 2.0**-10,
    torch.bfloat16: 2.0**-7,
    torch.float32: 2.0**-22,
    torch.float64: 2.0**-50,
}


def make_input(seed: int, case: int, rank: int, n: int, dtype: torch.dtype, op: ReduceOp | None) -> torch.Tensor:
    """Fresh random values that keep every op in range: PRODUCT near 1, integers small."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + case * 1009 + rank)
    if dtype.is_floating_point:
        if op is ReduceOp.PRODUCT:
            values = 0.5 + torch.rand(n, generator=gen, dtype=torch.float64)
        else:
            values = torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1
        return values.to(dtype)
    high = 3 if op is ReduceOp.PRODUCT else 100
    return torch.randint(-high, high + 1, (n,), generator=gen, dtype=dtype)


def reference(inputs: list[torch.Tensor], op: ReduceOp, dtype: torch.dtype) -> torch.Tensor:
    stack = torch.stack([t.to(torch.float64) for t in inputs]) if dtype.is_floating_point else torch.stack(inputs)
    if op is ReduceOp.SUM:
        return stack.sum(0)
    if op is ReduceOp.AVG:
        total = stack.sum(0)
        if dtype.is_floating_point:
            return total / len(inputs)
        return torch.div(total, len(inputs), rounding_mode="trunc")
    if op is ReduceOp.PRODUCT:
        return stack.prod(0)
    if op is ReduceOp.MIN:
        return stack.min(0).values
    return stack.max(0).values


def close_enough(out: torch.Tensor, ref: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp) -> bool:
    if not out.dtype.is_floating_point:
        return torch.equal(out, ref.to(out.dtype))
    eps = _EPS[out.dtype]
    # Error bound of an fp32/fp64 fold rounded once to the dtype: a few ulps of the
    # magnitudes involved (sum of |x| covers cancellation), relative for products.
    if op is ReduceOp.PRODUCT:
        bound = 4 * eps * ref.abs() + 1e-300
    else:
        scale = torch.stack([t.to(torch.float64).abs() for t in inputs]).sum(0)
        bound = 2 * eps * torch.maximum(scale, ref.abs()) + 1e-300
    return bool(((out.to(torch.float64) - ref).abs() <= bound).all())


def poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-7777777)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:12]


class Matrix:
    """Runs cases on this rank, collecting failures and cross-rank digests."""

    def __init__(self, seed: int, device: str = "cpu", group: object = None) -> None:
        self.seed = seed
        self.device = device
        self.group = group
        self.rank = dist.get_rank(group)
        self.P = dist.get_world_size(group)
        self.case = 0
        self.failures: list[str] = []
        self.digests: list[str] = []

    def inputs(self, n: int, dtype: torch.dtype, op: ReduceOp | None = None) -> list[torch.Tensor]:
        self.case += 1
        return [make_input(self.seed, self.case, r, n, dtype, op) for r in range(self.P)]

    def dev(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def fail(self, what: str) -> None:
        self.failures.append(f"rank {self.rank}: {what}")

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.fail(what)

    # -- reductions -------------------------------------------------------------------------
    def all_reduce(self, n: int, dtype: torch.dtype, op: ReduceOp, async_op: bool = False) -> None:
        ins = self.inputs(n, dtype, op)
        t = self.dev(ins[self.rank].clone())
        work = dist.all_reduce(t, op=op, group=self.group, async_op=async_op)
        if async_op:
            work.wait()
        ref = reference(ins, op, dtype)
        self.expect(close_enough(t.cpu(), ref, ins, op), f"all_reduce n={n} {dtype} {op.name} async={async_op}")
        self.digests.append(digest(t))

    def reduce(self, n: int, dtype: torch.dtype, op: ReduceOp) -> None:
        ins = self.inputs(n, dtype, op)
        dst = self.case % self.P
        t = self.dev(ins[self.rank].clone())
        dist.reduce(t, dst=self._global(dst), op=op, group=self.group)
        if self.rank == dst:
            self.expect(close_enough(t.cpu(), reference(ins, op, dtype), ins, op), f"reduce n={n} {dtype} {op.name} dst={dst}")
        else:
            self.expect(torch.equal(t.cpu(), ins[self.rank]), f"reduce n={n} {dtype} {op.name}: non-root tensor changed")

    def reduce_scatter(self, n: int, dtype: torch.dtype, op: ReduceOp, form: str) -> None:
        ins = self.inputs(n * self.P, dtype, op)
        out = poison(self.dev(torch.empty(n, dtype=dtype)))
        mine = self.dev(ins[self.rank].clone())
        if form == "list":
            dist.reduce_scatter(out, list(mine.chunk(self.P)) if n else [mine[:0]] * self.P, op=op, group=self.group)
        elif form == "tensor":
            dist.reduce_scatter_tensor(out, mine, op=op, group=self.group)
        else:
            dist.reduce_scatter_single(out, mine, op=op, group=self.group)
        chunks = [t[self.rank * n : (self.rank + 1) * n] for t in ins]
        self.expect(close_enough(out.cpu(), reference(chunks, op, dtype), chunks, op), f"reduce_scatter[{form}] n={n} {dtype} {op.name}")
        self.expect(torch.equal(mine.cpu(), ins[self.rank]), f"reduce_scatter[{form}] changed its input")

    # -- data movement ----------------------------------------------------------------------
    def broadcast(self, n: int, dtype: torch.dtype) -> None:
        ins = self.inputs(n, dtype)
        src = self.case % self.P
        t = self.dev(ins[self.rank].clone())
        dist.broadcast(t, src=self._global(src), group=self.group)
        self.expect(torch.equal(t.cpu(), ins[src]), f"broadcast n={n} {dtype} src={src}")

    def all_gather(self, n: int, dtype: torch.dtype, form: str) -> None:
        ins = self.inputs(n, dtype)
        mine = self.dev(ins[self.rank].clone())
        if form == "list":
            outs = [poison(self.dev(torch.empty(n, dtype=dtype))) for _ in range(self.P)]
            dist.all_gather(outs, mine, group=self.group)
            got = torch.cat([o.cpu() for o in outs])
        else:
            out = poison(self.dev(torch.empty(n * self.P, dtype=dtype)))
            fn = dist.all_gather_into_tensor if form == "tensor" else dist.all_gather_single
            fn(out, mine, group=self.group)
            got = out.cpu()
        self.expect(torch.equal(got, torch.cat(ins)), f"all_gather[{form}] n={n} {dtype}")

    def gather(self, n: int, dtype: torch.dtype) -> None:
        ins = self.inputs(n, dtype)
        dst = self.case % self.P
        outs = [poison(self.dev(torch.empty(n, dtype=dtype))) for _ in range(self.P)] if self.rank == dst else None
        dist.gather(self.dev(ins[self.rank].clone()), outs, dst=self._global(dst), group=self.group)
        if outs is not None:
            self.expect(torch.equal(torch.cat([o.cpu() for o in outs]), torch.cat(ins)), f"gather n={n} {dtype} dst={dst}")

    def scatter(self, n: int, dtype: torch.dtype) -> None:
        ins = self.inputs(n * self.P, dtype)
        src = self.case % self.P
        out = poison(self.dev(torch.empty(n, dtype=dtype)))
        pieces = [self.dev(c.clone()) for c in ins[src].split(n)] if n else [self.dev(torch.empty(0, dtype=dtype))] * self.P
        dist.scatter(out, pieces if self.rank == src else None, src=self._global(src), group=self.group)
        self.expect(torch.equal(out.cpu(), ins[src][self.rank * n : (self.rank + 1) * n]), f"scatter n={n} {dtype} src={src}")

    def all_to_all(self, n: int, dtype: torch.dtype, form: str) -> None:
        # Rank r sends (r + j) % 3 + n elements to rank j: unequal splits.
        count = [[(r + j) % 3 + n for j in range(self.P)] for r in range(self.P)]
        ins = self.inputs(sum(max(row) for row in count) * self.P, dtype)
        sent = [list(ins[r].split(count[r] + [ins[r].numel() - sum(count[r])])[: self.P]) for r in range(self.P)]
        me = self.rank
        expected = torch.cat([sent[j][me] for j in range(self.P)])
        if form == "list":
            outs = [poison(self.dev(torch.empty(count[j][me], dtype=dtype))) for j in range(self.P)]
            dist.all_to_all(outs, [self.dev(t.clone()) for t in sent[me]], group=self.group)
            got = torch.cat([o.cpu() for o in outs])
        else:
            out = poison(self.dev(torch.empty(expected.numel(), dtype=dtype)))
            inp = self.dev(torch.cat(sent[me]))
            dist.all_to_all_single(out, inp, [count[j][me] for j in range(self.P)], count[me], group=self.group)
            got = out.cpu()
        self.expect(torch.equal(got, expected), f"all_to_all[{form}] n={n} {dtype}")

    def all_to_all_equal(self, n: int, dtype: torch.dtype) -> None:
        ins = self.inputs(n * self.P, dtype)
        out = poison(self.dev(torch.empty(n * self.P, dtype=dtype)))
        dist.all_to_all_single(out, self.dev(ins[self.rank].clone()), group=self.group)
        expected = torch.cat([ins[j][self.rank * n : (self.rank + 1) * n] for j in range(self.P)])
        self.expect(torch.equal(out.cpu(), expected), f"all_to_all_single equal n={n} {dtype}")

    def send_recv(self, n: int, dtype: torch.dtype) -> None:
        """A ring: everyone isends to the next rank and receives from the previous one."""
        ins = self.inputs(n, dtype)
        if self.P == 1:
            return
        nxt, prv = (self.rank + 1) % self.P, (self.rank - 1) % self.P
        out = poison(self.dev(torch.empty(n, dtype=dtype)))
        send = dist.isend(self.dev(ins[self.rank].clone()), dst=self._global(nxt), group=self.group, tag=3)
        src = dist.recv(out, src=self._global(prv), group=self.group, tag=3)
        send.wait()
        self.expect(torch.equal(out.cpu(), ins[prv]) and src == self._global(prv), f"send/recv n={n} {dtype}")

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return self.group.global_ranks[group_rank]


def run_everything(m: Matrix, sizes: tuple[int, ...] = SIZES, dtypes: tuple[torch.dtype, ...] = DTYPES, ops: tuple[ReduceOp, ...] = OPS) -> None:
    """The whole matrix, in the same order on every rank."""
    for dtype in dtypes:
        for n in sizes:
            for op in ops:
                m.all_reduce(n, dtype, op)
                m.reduce(n, dtype, op)
                m.reduce_scatter(n, dtype, op, ("list", "tensor", "single")[m.case % 3])
            m.broadcast(n, dtype)
            for form in ("list", "tensor", "single"):
                m.all_gather(n, dtype, form)
            m.gather(n, dtype)
            m.scatter(n, dtype)
            m.all_to_all(n, dtype, "list")
            m.all_to_all(n, dtype, "single")
            m.all_to_all_equal(n, dtype)
            m.send_recv(n, dtype)
    m.all_reduce(4099, torch.float32, ReduceOp.SUM, async_op=True)
    m.barrier()

