"""The collectives measured, in nccl-tests' conventions: sizes, bus-bandwidth factors, buffers.

Sizes (nccl-tests' doc/PERFORMANCE.md): for all_reduce, broadcast, reduce and sendrecv the size is
one rank's buffer; for all_gather, reduce_scatter, alltoall, gather and scatter it is the full
buffer (all ranks' pieces together), and ``count`` is the elements of one piece.

``busbw = algbw * factor(n)``: the bandwidth each rank's link needs for the optimal algorithm,
comparable across collectives and world sizes (see docs/benchmarks.md).

Out-of-place calls write a buffer apart from the input; in-place calls write a buffer that aliases
it (all_gather's input is the rank's slice of the output, and so on). torch.distributed has no
out-of-place all_reduce, broadcast or reduce: there "out-of-place" copies the input into the
output and reduces that in place, which is what a caller of this API does, and the time includes
the copy. gpucomm's out-of-place all_reduce column is its own ``gpucomm.all_reduce_into(recv, send)``
(no copy: its programs read the send buffer and write the receive buffer, as NCCL's sendbuff !=
recvbuff does); torch.distributed's (gloo's) is ``recv.copy_(send)`` then ``all_reduce(recv)``.
gpucomm's broadcast and reduce keep the copy, as torch's. alltoall and sendrecv have no in-place
form (NCCL refuses aliased alltoall buffers, and an aliased send/recv races), so their in-place
columns read N/A, as in nccl-tests.

Every tensor a collective reads or writes is a view of the rank's send or receive buffer, allocated
once for the whole run (bench/buffers.py), as nccl-tests' sendbuff and recvbuff are.

Check inputs are small integers whose results are exact in every dtype and summation order:
sum in [-4, 4], prod in {1, 2}, min/max in [-8, 8], avg n*[-2, 2] (so the mean is an integer),
data movement in [-100, 100]; the reference folds them in int64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from .buffers import Buffers

__all__ = ["Case", "Prepared", "Spec", "SPECS", "COLLECTIVES", "CHECK_RANGES", "poison_value", "rank_values"]


@dataclass(frozen=True)
class Case:
    """One row: ``count`` is nccl-tests' count column (elements of one rank's piece)."""

    rank: int
    world: int
    count: int
    dtype: torch.dtype
    device: torch.device
    op: str
    root: int
    seed: int
    # The rank's buffers, allocated once and reused by every row (bench/buffers.py); None: each
    # prepare allocates its own (tests that build a Case by hand).
    buffers: Buffers | None = None


@dataclass
class Prepared:
    """One (collective, size, variant) on this rank.

    ``call`` is the timed collective; ``reset`` restores the inputs and poisons the outputs;
    ``result`` is what this rank checks after one call (None: nothing lands here, e.g. reduce on
    a non-root rank) and ``expected()`` its exact value.
    """

    call: Callable[[], None]
    reset: Callable[[], None]
    result: torch.Tensor | None
    expected: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Spec:
    name: str
    factor: Callable[[int], float]
    split: bool  # size = world * count * elem (the buffer holds every rank's piece)
    reducing: bool
    rooted: bool
    min_world: int
    # (case, backend module, ReduceOp object, inplace) -> Prepared, or None where no such variant
    prepare: Callable[[Case, object, object, bool], Prepared | None]

    def size_bytes(self, count: int, world: int, elem: int) -> int:
        return count * elem * (world if self.split else 1)

    def count_for(self, size: int, world: int, elem: int) -> int:
        """Elements of one piece for a requested size (at least 1, as a zero-size row says nothing)."""
        return max(1, size // (elem * (world if self.split else 1)))


CHECK_RANGES = {"data": (-100, 100), "sum": (-4, 4), "prod": (1, 2), "min": (-8, 8), "max": (-8, 8), "avg": (-2, 2)}


def rank_values(case: Case, rank: int, numel: int, kind: str) -> torch.Tensor:
    """Rank ``rank``'s input of ``numel`` elements as int64: every rank can rebuild every other's."""
    low, high = CHECK_RANGES[kind]
    gen = torch.Generator(device=case.device)
    # A tuple of ints hashes the same in every process (strings do not: PYTHONHASHSEED).
    kind_id = list(CHECK_RANGES).index(kind)
    gen.manual_seed(hash((case.seed, rank, numel, kind_id)) & 0x7FFF_FFFF_FFFF_FFFF)
    values = torch.randint(low, high + 1, (numel,), generator=gen, device=case.device, dtype=torch.int64)
    return values * case.world if kind == "avg" else values


def poison_value(dtype: torch.dtype) -> float | int:
    """NaN for floats, the most negative integer otherwise: no check input ever equals it."""
    return float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min


def _reduced(case: Case, numel: int) -> torch.Tensor:
    """The exact reduction over all ranks of their ``numel``-element inputs, in int64."""
    acc = rank_values(case, 0, numel, case.op)
    for r in range(1, case.world):
        x = rank_values(case, r, numel, case.op)
        if case.op in ("sum", "avg"):
            acc = acc + x
        elif case.op == "prod":
            acc = acc * x
        elif case.op == "min":
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    return acc // case.world if case.op == "avg" else acc


def _empty(case: Case, numel: int, role: str) -> torch.Tensor:
    """``numel`` elements of the rank's ``role`` buffer ("send" or "recv", bench/buffers.py)."""
    if case.buffers is None:
        return torch.empty(numel, dtype=case.dtype, device=case.device)
    return case.buffers.take(role, numel, case.dtype)


def _fill(buf: torch.Tensor, values: torch.Tensor) -> None:
    buf.copy_(values.to(buf.dtype))


def _poison(buf: torch.Tensor) -> None:
    buf.fill_(poison_value(buf.dtype))


# Expected results, built lazily (only when the check is on) with functools.partial.
def _want_reduced(case: Case, numel: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
    return _reduced(case, numel)[start:stop].to(case.dtype)


def _want_data(case: Case, rank: int, numel: int, start: int = 0, stop: int | None = None) -> torch.Tensor:
    return rank_values(case, rank, numel, "data")[start:stop].to(case.dtype)


def _want_all_pieces(case: Case, numel: int) -> torch.Tensor:
    return torch.cat([rank_values(case, q, numel, "data") for q in range(case.world)]).to(case.dtype)


def _all_reduce(case: Case, mod, op, inplace: bool) -> Prepared:
    c = case.count
    inp = rank_values(case, case.rank, c, case.op)
    if inplace:
        buf = _empty(case, c, "recv")
        return Prepared(
            lambda: mod.all_reduce(buf, op=op), lambda: _fill(buf, inp), buf, partial(_want_reduced, case, c)
        )
    src, out = _empty(case, c, "send"), _empty(case, c, "recv")
    into = getattr(mod, "all_reduce_into", None)
    if into is not None:  # gpucomm: native out-of-place, as nccl-tests' sendbuff != recvbuff

        def call() -> None:
            into(out, src, op=op)

    else:  # torch.distributed (gloo) has no out-of-place all_reduce: the copy a caller makes, timed

        def call() -> None:
            out.copy_(src)
            mod.all_reduce(out, op=op)

    def reset() -> None:
        _fill(src, inp)
        _poison(out)

    return Prepared(call, reset, out, partial(_want_reduced, case, c))


def _broadcast(case: Case, mod, op, inplace: bool) -> Prepared:
    c, root, is_root = case.count, case.root, case.rank == case.root
    inp = rank_values(case, case.rank, c, "data")
    expected = partial(_want_data, case, root, c)
    if inplace:
        buf = _empty(case, c, "recv")
        return Prepared(
            lambda: mod.broadcast(buf, src=root), lambda: _fill(buf, inp) if is_root else _poison(buf), buf, expected
        )
    src, out = _empty(case, c, "send"), _empty(case, c, "recv")

    def call() -> None:
        if is_root:
            out.copy_(src)
        mod.broadcast(out, src=root)

    def reset() -> None:
        _fill(src, inp)
        _poison(out)

    return Prepared(call, reset, out, expected)


def _reduce(case: Case, mod, op, inplace: bool) -> Prepared:
    c, root = case.count, case.root
    inp = rank_values(case, case.rank, c, case.op)
    expected = partial(_want_reduced, case, c)
    if inplace:
        buf = _empty(case, c, "recv")
        return Prepared(
            lambda: mod.reduce(buf, dst=root, op=op),
            lambda: _fill(buf, inp),
            buf if case.rank == root else None,
            expected,
        )
    src, out = _empty(case, c, "send"), _empty(case, c, "recv")

    def call() -> None:
        out.copy_(src)
        mod.reduce(out, dst=root, op=op)

    def reset() -> None:
        _fill(src, inp)
        _poison(out)

    return Prepared(call, reset, out if case.rank == root else None, expected)


def _all_gather(case: Case, mod, op, inplace: bool) -> Prepared:
    c, n, r = case.count, case.world, case.rank
    mine = rank_values(case, r, c, "data")
    out = _empty(case, n * c, "recv")
    src = out[r * c : (r + 1) * c] if inplace else _empty(case, c, "send")

    def reset() -> None:
        _poison(out)
        _fill(src, mine)

    expected = partial(_want_all_pieces, case, c)
    return Prepared(lambda: mod.all_gather_into_tensor(out, src), reset, out, expected)


def _reduce_scatter(case: Case, mod, op, inplace: bool) -> Prepared:
    c, n, r = case.count, case.world, case.rank
    mine = rank_values(case, r, n * c, case.op)
    src = _empty(case, n * c, "send")
    out = src[r * c : (r + 1) * c] if inplace else _empty(case, c, "recv")

    def reset() -> None:
        _poison(out)
        _fill(src, mine)

    expected = partial(_want_reduced, case, n * c, r * c, (r + 1) * c)
    return Prepared(lambda: mod.reduce_scatter_tensor(out, src, op=op), reset, out, expected)


def _alltoall(case: Case, mod, op, inplace: bool) -> Prepared | None:
    if inplace:
        return None
    c, n, r = case.count, case.world, case.rank
    mine = rank_values(case, r, n * c, "data")
    src, out = _empty(case, n * c, "send"), _empty(case, n * c, "recv")

    def reset() -> None:
        _fill(src, mine)
        _poison(out)

    def expected() -> torch.Tensor:
        pieces = [rank_values(case, q, n * c, "data")[r * c : (r + 1) * c] for q in range(n)]
        return torch.cat(pieces).to(case.dtype)

    return Prepared(lambda: mod.all_to_all_single(out, src), reset, out, expected)


def _gather(case: Case, mod, op, inplace: bool) -> Prepared:
    c, n, r, root = case.count, case.world, case.rank, case.root
    mine = rank_values(case, r, c, "data")
    out = _empty(case, n * c, "recv")
    src = out[r * c : (r + 1) * c] if inplace else _empty(case, c, "send")
    pieces = list(out.split(c)) if r == root else None

    def reset() -> None:
        _poison(out)
        _fill(src, mine)

    expected = partial(_want_all_pieces, case, c)
    return Prepared(lambda: mod.gather(src, gather_list=pieces, dst=root), reset, out if r == root else None, expected)


def _scatter(case: Case, mod, op, inplace: bool) -> Prepared:
    c, n, r, root = case.count, case.world, case.rank, case.root
    mine = rank_values(case, r, n * c, "data")
    src = _empty(case, n * c, "send")
    out = src[r * c : (r + 1) * c] if inplace else _empty(case, c, "recv")
    pieces = list(src.split(c)) if r == root else None

    def reset() -> None:
        _fill(src, mine)
        # On the root the in-place output is its own piece of the input: poisoning it would
        # poison what it sends to itself.
        if not (inplace and r == root):
            _poison(out)

    expected = partial(_want_data, case, root, n * c, r * c, (r + 1) * c)
    return Prepared(lambda: mod.scatter(out, scatter_list=pieces, src=root), reset, out, expected)


def _sendrecv(case: Case, mod, op, inplace: bool) -> Prepared | None:
    if inplace:
        return None
    c, n, r = case.count, case.world, case.rank
    mine = rank_values(case, r, c, "data")
    src, out = _empty(case, c, "send"), _empty(case, c, "recv")

    def call() -> None:
        # Each rank sends to the next and receives from the previous: every link busy at once.
        works = [mod.isend(src, (r + 1) % n), mod.irecv(out, (r - 1) % n)]
        for work in works:
            work.wait()

    def reset() -> None:
        _fill(src, mine)
        _poison(out)

    return Prepared(call, reset, out, partial(_want_data, case, (r - 1) % n, c))


def _all_reduce_factor(n: int) -> float:
    return 2 * (n - 1) / n


def _split_factor(n: int) -> float:
    return (n - 1) / n


def _one(n: int) -> float:
    return 1.0


SPECS = {
    s.name: s
    for s in (
        Spec("all_reduce", _all_reduce_factor, False, True, False, 1, _all_reduce),
        Spec("all_gather", _split_factor, True, False, False, 1, _all_gather),
        Spec("reduce_scatter", _split_factor, True, True, False, 1, _reduce_scatter),
        Spec("broadcast", _one, False, False, True, 1, _broadcast),
        Spec("reduce", _one, False, True, True, 1, _reduce),
        Spec("gather", _split_factor, True, False, True, 1, _gather),
        Spec("scatter", _split_factor, True, False, True, 1, _scatter),
        Spec("alltoall", _split_factor, True, False, False, 1, _alltoall),
        Spec("sendrecv", _one, False, False, False, 2, _sendrecv),
    )
}
COLLECTIVES = tuple(SPECS)
