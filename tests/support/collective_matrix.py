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
    """``op`` over the ranks' ``inputs``, in float64 for floats (AVG of integers truncates)."""
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


def close_enough(
    out: torch.Tensor, ref: torch.Tensor, inputs: list[torch.Tensor], op: ReduceOp, roundings: int = 1
) -> bool:
    """``roundings``: how many times the algorithm rounds partial results to the dtype (ring and
    tree store 16-bit partials once per step); each costs at most half an ulp of the partial."""
    if not out.dtype.is_floating_point:
        return torch.equal(out, ref.to(out.dtype))
    eps = _EPS[out.dtype] * max(1, roundings) if out.dtype in (torch.float16, torch.bfloat16) else _EPS[out.dtype]
    # Error bound of an fp32/fp64 fold rounded once to the dtype: a few ulps of the
    # magnitudes involved (sum of |x| covers cancellation), relative for products.
    if op is ReduceOp.PRODUCT:
        bound = 4 * eps * ref.abs() + 1e-300
    else:
        scale = torch.stack([t.to(torch.float64).abs() for t in inputs]).sum(0)
        bound = 2 * eps * torch.maximum(scale, ref.abs()) + 1e-300
    return bool(((out.to(torch.float64) - ref).abs() <= bound).all())


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with what no collective writes (NaN, or an unlikely integer); returns ``t``."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-7777777)


def digest(t: torch.Tensor) -> str:
    """A short hash of ``t``'s bytes, compared across ranks."""
    return hashlib.sha1(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:12]


class Matrix:
    """Runs cases on this rank, collecting failures and cross-rank digests."""

    def __init__(self, seed: int, device: str = "cpu", group: object = None, roundings: int = 1) -> None:
        self.seed = seed
        self.roundings = roundings  # see close_enough
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
        self.expect(
            close_enough(t.cpu(), ref, ins, op, self.roundings), f"all_reduce n={n} {dtype} {op.name} async={async_op}"
        )
        self.digests.append(digest(t))

    def reduce(self, n: int, dtype: torch.dtype, op: ReduceOp) -> None:
        ins = self.inputs(n, dtype, op)
        dst = self.case % self.P
        t = self.dev(ins[self.rank].clone())
        dist.reduce(t, dst=self._global(dst), op=op, group=self.group)
        if self.rank == dst:
            self.expect(
                close_enough(t.cpu(), reference(ins, op, dtype), ins, op, self.roundings),
                f"reduce n={n} {dtype} {op.name} dst={dst}",
            )
        else:
            self.expect(
                torch.equal(t.cpu(), ins[self.rank]), f"reduce n={n} {dtype} {op.name}: non-root tensor changed"
            )

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
        self.expect(
            close_enough(out.cpu(), reference(chunks, op, dtype), chunks, op, self.roundings),
            f"reduce_scatter[{form}] n={n} {dtype} {op.name}",
        )
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
            self.expect(
                torch.equal(torch.cat([o.cpu() for o in outs]), torch.cat(ins)), f"gather n={n} {dtype} dst={dst}"
            )

    def scatter(self, n: int, dtype: torch.dtype) -> None:
        ins = self.inputs(n * self.P, dtype)
        src = self.case % self.P
        out = poison(self.dev(torch.empty(n, dtype=dtype)))
        pieces = (
            [self.dev(c.clone()) for c in ins[src].split(n)] if n else [self.dev(torch.empty(0, dtype=dtype))] * self.P
        )
        dist.scatter(out, pieces if self.rank == src else None, src=self._global(src), group=self.group)
        self.expect(
            torch.equal(out.cpu(), ins[src][self.rank * n : (self.rank + 1) * n]), f"scatter n={n} {dtype} src={src}"
        )

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

    def ping_pong(self, n: int, dtype: torch.dtype, a: int, b: int, tag: int = 0) -> None:
        """Rank a adds 1 and sends to b; b adds 2 and sends back; a checks x + 3."""
        # Small integers in every dtype, so that (x + 1) + 2 == x + 3 exactly.
        x = (self.inputs(n, dtype)[a].to(torch.float64) * 8).round().to(dtype)
        if self.rank == a:
            t = self.dev(x + 1)
            dist.send(t, dst=self._global(b), group=self.group, tag=tag)
            back = poison(self.dev(torch.empty(n, dtype=dtype)))
            src = dist.recv(back, src=self._global(b), group=self.group, tag=tag)
            self.expect(torch.equal(back.cpu(), x + 3) and src == self._global(b), f"ping-pong {a}<->{b} n={n} {dtype}")
        elif self.rank == b:
            t = poison(self.dev(torch.empty(n, dtype=dtype)))
            src = dist.recv(t, src=None, group=self.group, tag=tag)  # any source
            self.expect(torch.equal(t.cpu(), x + 1) and src == self._global(a), f"ping-pong {a}->{b} n={n} {dtype}")
            dist.send(t + 2, dst=self._global(a), group=self.group, tag=tag)

    def tags_apart(self, n: int, dtype: torch.dtype) -> None:
        """Every rank isends three messages with different tags to the next rank, and receives
        them from the previous one in the reverse order: tags are matched, not queued."""
        ins = self.inputs(3 * n, dtype)
        if self.P == 1:
            return
        nxt, prv = (self.rank + 1) % self.P, (self.rank - 1) % self.P
        mine, theirs = (
            ins[self.rank].split(n) if n else [ins[self.rank]] * 3,
            ins[prv].split(n) if n else [ins[prv]] * 3,
        )
        sends = [
            dist.isend(self.dev(mine[i].clone()), dst=self._global(nxt), group=self.group, tag=10 + i) for i in range(3)
        ]
        outs = [poison(self.dev(torch.empty(n, dtype=dtype))) for _ in range(3)]
        recvs = [dist.irecv(outs[i], src=self._global(prv), group=self.group, tag=10 + i) for i in (2, 1, 0)]
        for work in recvs + sends:
            work.wait()
        for i in range(3):
            self.expect(torch.equal(outs[i].cpu(), theirs[i]), f"tags_apart tag={10 + i} n={n} {dtype}")

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return self.group.global_ranks[group_rank]


def run_everything(
    m: Matrix, sizes: tuple[int, ...] = SIZES, dtypes: tuple[torch.dtype, ...] = DTYPES, ops: tuple[ReduceOp, ...] = OPS
) -> None:
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


# What each algorithm serves on the workspace path (gpucomm.algorithms.select.ALGORITHMS).
SERVES = {
    "oneshot": ("all_reduce",),
    "twoshot": ("all_reduce",),
    "ring": ("all_reduce", "all_gather", "reduce_scatter"),
    "tree": ("all_reduce", "broadcast", "reduce"),
    "spread": ("broadcast", "reduce"),
    "direct": (
        "broadcast",
        "reduce",
        "all_gather",
        "reduce_scatter",
        "gather",
        "scatter",
        "all_to_all",
        "p2p",
        "barrier",
    ),
    # Ranks spanning (pretended) nodes: every collective but send/recv (gloo's); the whole
    # matrix of them runs in tests/distributed/test_across_nodes.py.
    "hierarchical": (
        "all_reduce",
        "broadcast",
        "reduce",
        "all_gather",
        "reduce_scatter",
        "gather",
        "all_to_all",
        "barrier",
    ),
}


def run_algorithm(
    m: Matrix,
    algo: str,
    sizes: tuple[int, ...] = SIZES,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    ops: tuple[ReduceOp, ...] = OPS,
) -> None:
    """Every collective that ``algo`` serves, for every dtype x size (x op), in the same order
    on every rank; both forms of all_gather and reduce_scatter take turns."""
    serves = SERVES[algo]
    for dtype in dtypes:
        for n in sizes:
            for op in ops:
                _reductions(m, serves, n, dtype, op)
            _movement(m, serves, n, dtype)
    if "p2p" in serves:
        for a in range(m.P):
            for b in range(m.P):
                if a != b:
                    m.ping_pong(max(sizes), dtypes[(a + b) % len(dtypes)], a, b, tag=a)
        m.tags_apart(max(sizes), dtypes[0])
    if "all_reduce" in serves:
        m.all_reduce(max(sizes), dtypes[0], ops[0], async_op=True)
    if "barrier" in serves:
        m.barrier()


def _reductions(m: Matrix, serves: tuple[str, ...], n: int, dtype: torch.dtype, op: ReduceOp) -> None:
    if "all_reduce" in serves:
        m.all_reduce(n, dtype, op)
    if "reduce" in serves:
        m.reduce(n, dtype, op)
    if "reduce_scatter" in serves:
        m.reduce_scatter(n, dtype, op, ("list", "tensor")[m.case % 2])


def _movement(m: Matrix, serves: tuple[str, ...], n: int, dtype: torch.dtype) -> None:
    if "broadcast" in serves:
        m.broadcast(n, dtype)
    if "all_gather" in serves:
        m.all_gather(n, dtype, ("list", "tensor")[m.case % 2])
    if "gather" in serves:
        m.gather(n, dtype)
        m.scatter(n, dtype)
    if "all_to_all" in serves:
        m.all_to_all(n, dtype, ("list", "single")[m.case % 2])
        m.all_to_all_equal(n, dtype)
    if "p2p" in serves:
        m.send_recv(n, dtype)


def run_lean(m: Matrix, algo: str, sizes: tuple[int, ...]) -> None:
    """For each size, every collective that ``algo`` serves with every dtype once (reductions,
    the ops taking turns) or with two dtypes (data movement): every dtype and every op at least
    once per algorithm and size, in few calls (for the slow Triton interpreter, and for sizes
    that span many pieces)."""
    serves = SERVES[algo]
    for k, n in enumerate(sizes):
        for i, dtype in enumerate(DTYPES):
            _reductions(m, serves, n, dtype, OPS[(i + k) % len(OPS)])
        for dtype in (DTYPES[k % len(DTYPES)], DTYPES[(k + 3) % len(DTYPES)]):
            _movement(m, serves, n, dtype)
        if "p2p" in serves:
            m.ping_pong(n, DTYPES[(k + 1) % len(DTYPES)], 0, m.P - 1, tag=5)
    if "barrier" in serves:
        m.barrier()


def roundings(label: str, world_size: int) -> int:
    """How often an algorithm rounds 16-bit partial results (see close_enough)."""
    if label == "ring":
        return world_size  # P-1 partial sums, then the last step
    if label == "tree":
        return world_size.bit_length()  # one per level, and the root
    return 1  # one-shot, two-shot and hierarchical (16-bit floats staged in fp32) round once


def workspace_rank(
    rank: int, world_size: int, seed: int, device: str, knobs: dict, plan: list[tuple]
) -> dict[str, tuple[list[str], list[str], list[str]]]:
    """Rank body of the workspace-path tests: one Communicator per plan entry.

    ``knobs`` go to init_process_group (transport, kernels, workspace_bytes, ...); each plan
    entry is ``(label, algo, overrides, kind, args)``: a Communicator with the world's config
    plus ``overrides`` runs ``run_algorithm(m, algo, *args)`` (kind "full") or ``run_lean(m,
    algo, *args)`` (kind "lean"). Returns, per label, the failures, the all_reduce digests and
    the GPUCOMM_DEBUG=INFO lines of that Communicator's calls.
    """
    import dataclasses
    import io
    import logging

    from gpucomm.comm.communicator import Communicator

    dist.init_process_group(debug="INFO", **knobs)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    stream = io.StringIO()
    logging.getLogger("gpucomm").addHandler(logging.StreamHandler(stream))
    world = dist.get_default_communicator()
    results = {}
    for label, algo, overrides, kind, args in plan:
        config = dataclasses.replace(world.config, **overrides)
        comm = Communicator(world.store, rank, world_size, prefix=f"{world.prefix}{label}/", config=config)
        m = Matrix(seed, device=device, group=comm, roundings=roundings(algo, world_size))
        stream.seek(0)
        stream.truncate()
        try:
            (run_algorithm if kind == "full" else run_lean)(m, algo, *args)
        finally:
            comm.close()
        results[label] = (m.failures, m.digests, stream.getvalue().splitlines())
    dist.destroy_process_group()
    return results
