"""Checked gloo collectives: every rank's fingerprint of the call travels with its first bytes.

With ``GPUCOMM_CHECK`` on (the default), each collective the gloo path serves starts with one
*exchange*: every rank sends every rank a slot of :func:`slot_bytes` bytes that begins with its
fingerprint of the call (collective, dtype, size, op, root). Every rank compares all the
fingerprints before anything is written into the caller's tensors, so ranks that called
different things raise :class:`CommMismatchError` together. Three forms:

- **small** (the data fits in a slot): the slots carry the data too, and the collective is that
  one exchange, then local work in rank order once the fingerprints match. Reductions fold the
  ranks' data with :func:`gpucomm.ops.reference.fold_into` (fp32 accumulation for 16-bit
  floats, one rounding, AVG divided once, integers truncating): the workspace path's numerics,
  the same bits on every rank. The call enqueues the exchange and returns; its Work checks and
  finishes.
- **large**: the call waits for an exchange of fingerprints alone, then gloo's own collective
  runs, asynchronously as with ``GPUCOMM_CHECK=off``.
- **all_to_all**: each rank knows only its own row and column of the size matrix, so whether
  every piece fits is known only after the exchange, which carries every rank's sizes (every
  rank checks every pair, as the workspace path does) and the pieces where they fit; the call
  waits for it, then its Work copies the pieces out, or gloo's all_to_all moves them.

Why a slot has one size whatever each rank called: gloo aborts the whole process when the sizes
of a collective differ between ranks (``gloo::EnforceNotMet`` "Received data size doesn't match
expected size", thrown on gloo's own thread: ``terminate``; reproduced with torch 2.13 by an
allgather of 16 bytes on one rank and 64 on the other). For the same reason nothing whose size
depends on the call is enqueued before the fingerprints have been compared: the large form
waits in the call.

Why gloo's alltoall and not its allgather: gloo's allgather is a ring of 2(P-1) dependent steps,
its alltoall posts every send and receive at once. Measured on the 2-core VM (torch 2.13,
medians of 9 alternating rounds of 25 calls): 16 bytes per rank took 136 us by alltoall, 177 us
by allgather and 159 us for gloo's own 8-byte all_reduce at 2 ranks; 299, 509 and 305 us at 3.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from gpucomm.errors import CommMismatchError
from gpucomm.ops.reference import fold_into
from gpucomm.progress import wait_gloo
from gpucomm.reduce_op import ReduceOp, accumulation_dtype
from gpucomm.work import Work

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["CheckedGloo", "SlotPool", "slot_bytes", "capacity"]

# Bytes of the fingerprint at the start of every slot (one int64; what follows stays 8-byte
# aligned, so that the data can be viewed as its dtype where it lies).
_FINGERPRINT_BYTES = 8
# Bytes a rank sends each rank in the exchange. Measured on the 2-core VM (torch 2.13's gloo,
# alltoall of N bytes per peer on buffers kept from call to call, medians of 21 alternating
# rounds of 40 calls): flat up to 16 KiB at 2 ranks (two runs: 113 and 137 us at 64 B, 118 and
# 131 us at 4 KiB, 115 and 130 us at 16 KiB; gloo's own 8-byte all_reduce 141 and 150 us),
# rising at 3 ranks (271 us at 64 B, 279 at 1 KiB, 295 at 4 KiB, 313 at 16 KiB; all_reduce
# 290). Below a slot the small form is one exchange where the large form is the same exchange
# plus gloo's own collective, so every collective takes the small form wherever its data fits:
# the per-collective thresholds are the slot's capacity.
_SLOT_BYTES = 16 << 10
# Bytes a rank sends in all in one exchange, at most: the exchange moves P-1 slots; 16 KiB
# measured flat at 2 ranks, 2 x 16 KiB already cost 15% more at 3 (above), so more ranks get
# smaller slots (8 KiB at 3 ranks, 5 KiB at 4).
_EXCHANGE_BYTES = 16 << 10
# The smallest slot, whatever the world size: the fingerprint and 56 bytes of data (at 256
# ranks an exchange then moves 16 KiB per rank).
_MIN_SLOT_BYTES = 64
# Exchange buffers kept per device for reuse. Allocating and zeroing them for every call made
# an 8-byte all_reduce 50-70 us slower at 2 ranks on the 2-core VM (272-281 us against 200-233
# us with reused buffers, 9 alternating rounds); a few cover the calls a caller keeps in flight.
_POOL_DEPTH = 4
# Views kept per buffer, one per (offset, size, dtype) of the calls served (a training loop
# repeats a few); the cache starts afresh when a caller keeps changing sizes.
_VIEW_CACHE = 64


def _header_bytes(fn: str, world_size: int) -> int:
    """The fingerprint, and for all_to_all every rank's sizes (bytes sent to and expected from
    each rank, 2P int64) so that each rank can check every pair."""
    return _FINGERPRINT_BYTES + (16 * world_size if fn.startswith("all_to_all") else 0)


def slot_bytes(world_size: int) -> int:
    """Bytes each rank sends each rank in the exchange: the same for every call of a group."""
    share = _EXCHANGE_BYTES // max(world_size - 1, 1) // 8 * 8
    return max(min(_SLOT_BYTES, share), _MIN_SLOT_BYTES)


def capacity(fn: str, world_size: int) -> int:
    """The most data bytes a slot carries for ``fn`` (per destination rank); above it, ``fn``
    takes the large form."""
    return slot_bytes(world_size) - _header_bytes(fn, world_size)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as one dimension (itself when it has one)."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


class _Slots:
    """The buffers of one exchange on one device: ``send`` (row j goes to rank j) and
    ``received`` (row r came from rank r), P x slot bytes each, with views into them."""

    def __init__(self, world_size: int, slot: int, device: torch.device) -> None:
        # Zeroed once; a reused buffer carries as padding only bytes that this rank already
        # sent to the same rank (row j always goes to rank j).
        send = torch.zeros(world_size, slot // 8, dtype=torch.int64, device=device)
        received = torch.empty_like(send)
        self.device = device
        self.send, self.received = send.view(torch.uint8), received.view(torch.uint8)
        self._fingerprint_out, self._fingerprint_in = send[:, 0], received[:, 0]
        self._signed: int | None = None  # the fingerprint in send now
        self._views: dict[
            tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]
        ] = {}

    def sign(self, fingerprint: int) -> None:
        # A loop repeats its calls: the fingerprint is often there already.
        if fingerprint != self._signed:
            self._fingerprint_out.fill_(fingerprint)
            self._signed = fingerprint

    def fingerprints(self) -> list[int]:
        return self._fingerprint_in.tolist()

    def data(
        self, nbytes: int, dtype: torch.dtype, start: int = _FINGERPRINT_BYTES
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """The ``nbytes`` after ``start`` of every slot as ``dtype``: (sent, P x n), (received,
        P x n), and the received rows."""
        key = (start, nbytes, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _VIEW_CACHE:
                self._views.clear()
            received = self.received[:, start : start + nbytes].view(dtype)
            views = self._views[key] = (self.send[:, start : start + nbytes].view(dtype), received, received.unbind(0))
        return views


class SlotPool:
    """The exchange buffers of one group, reused from call to call."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.slot = slot_bytes(world_size)
        self.capacity = capacity("", world_size)  # of every collective but all_to_all
        self._free: dict[torch.device, list[_Slots]] = {}

    def take(self, device: torch.device) -> _Slots:
        free = self._free.get(device)
        return free.pop() if free else _Slots(self.world_size, self.slot, device)

    def give(self, slots: _Slots) -> None:
        """Back for reuse, once gloo is done with them and the local step has read them."""
        free = self._free.setdefault(slots.device, [])
        if len(free) < _POOL_DEPTH:
            free.append(slots)

    def clear(self) -> None:
        self._free.clear()


class CheckedGloo:
    """The collectives of a :class:`gpucomm.gloo.fallback.GlooFallback` (same methods, same
    arguments) for one call whose fingerprint is ``fingerprint``; ``describe(ranks)`` words the
    mismatch with the ranks whose fingerprint differs. ``native`` runs gloo's own collectives
    (the large form); ``pg`` carries the exchange."""

    __slots__ = ("_native", "_pg", "_pool", "_fingerprint", "_describe", "_rank", "_size")

    def __init__(
        self,
        native: object,
        pg: dist.ProcessGroup,
        pool: SlotPool,
        rank: int,
        fingerprint: int,
        describe: Callable[[list[int]], str],
    ) -> None:
        self._native = native
        self._pg = pg
        self._pool = pool
        self._rank = rank
        self._size = pool.world_size
        self._fingerprint = fingerprint
        self._describe = describe

    # -- the exchange -----------------------------------------------------------------------
    def _slots(self, device: torch.device) -> _Slots:
        slots = self._pool.take(device)
        slots.sign(self._fingerprint)
        return slots

    def _exchange(self, slots: _Slots) -> object:
        return self._pg.alltoall_base(slots.received, slots.send, [], [])

    def _verify(self, slots: _Slots) -> None:
        seen = slots.fingerprints()
        if seen.count(self._fingerprint) != self._size:
            raise CommMismatchError(self._describe([r for r, f in enumerate(seen) if f != self._fingerprint]))

    def _small(self, slots: _Slots, local: Callable[[], None] | None = None) -> Work:
        """The small form: the exchange; once it is complete, the check, then ``local()``."""
        work = self._exchange(slots)

        def finish() -> None:
            self._verify(slots)
            if local is not None:
                local()
            self._pool.give(slots)

        return Work([work], finish=finish)

    def _agree(self) -> None:
        """The large form's exchange of fingerprints alone, waited for in the call: gloo's own
        collective, whose sizes depend on the call, may start only once they match."""
        slots = self._slots(torch.device("cpu"))
        wait_gloo(self._exchange(slots))
        self._verify(slots)
        self._pool.give(slots)

    def _fits(self, tensor: torch.Tensor) -> bool:
        return tensor.nbytes <= self._pool.capacity

    def _folded(self, out: torch.Tensor, rows: Sequence[torch.Tensor], op: ReduceOp) -> Callable[[], None]:
        """Local step: ``out`` = ``rows`` reduced in rank order, in the workspace path's numerics."""
        flat = _flat(out)
        acc_dtype = accumulation_dtype(out.dtype)

        def fold() -> None:
            acc = None if acc_dtype == out.dtype else torch.empty_like(flat, dtype=acc_dtype)
            fold_into(flat, rows, op, self._size, acc)

        return fold

    # -- reductions -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        if not self._fits(tensor):
            self._agree()
            return self._native.all_reduce(tensor, op)
        slots = self._slots(tensor.device)
        sent, _, rows = slots.data(tensor.nbytes, tensor.dtype)
        sent.copy_(_flat(tensor))
        return self._small(slots, self._folded(tensor, rows, op))

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work:
        if not self._fits(tensor):
            self._agree()
            return self._native.reduce(tensor, dst, op)
        slots = self._slots(tensor.device)
        sent, _, rows = slots.data(tensor.nbytes, tensor.dtype)
        sent[dst].copy_(_flat(tensor))
        return self._small(slots, self._folded(tensor, rows, op) if self._rank == dst else None)

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: ReduceOp) -> Work:
        if not self._fits(output):
            self._agree()
            return self._native.reduce_scatter(output, inputs, op)
        slots = self._slots(output.device)
        sent, _, rows = slots.data(output.nbytes, output.dtype)
        for j, chunk in enumerate(inputs):
            sent[j].copy_(_flat(chunk))
        return self._small(slots, self._folded(output, rows, op))

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work:
        if not self._fits(output):
            self._agree()
            return self._native.reduce_scatter_tensor(output, input, op)
        slots = self._slots(output.device)
        sent, _, rows = slots.data(output.nbytes, output.dtype)
        sent.copy_(input.view(self._size, output.numel()))
        return self._small(slots, self._folded(output, rows, op))

    # -- data movement ----------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        if not self._fits(tensor):
            self._agree()
            return self._native.broadcast(tensor, src)
        slots = self._slots(tensor.device)
        sent, _, rows = slots.data(tensor.nbytes, tensor.dtype)
        if self._rank == src:
            sent.copy_(_flat(tensor))
            return self._small(slots)
        return self._small(slots, lambda: _flat(tensor).copy_(rows[src]))

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Work:
        if not self._fits(tensor):
            self._agree()
            return self._native.all_gather(outputs, tensor)
        slots = self._slots(tensor.device)
        sent, _, rows = slots.data(tensor.nbytes, tensor.dtype)
        sent.copy_(_flat(tensor))
        return self._small(slots, lambda: _copy_rows(outputs, rows))

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        if not self._fits(tensor):
            self._agree()
            return self._native.all_gather_into_tensor(output, tensor)
        slots = self._slots(tensor.device)
        sent, received, _ = slots.data(tensor.nbytes, tensor.dtype)
        sent.copy_(_flat(tensor))
        return self._small(slots, lambda: output.view(self._size, tensor.numel()).copy_(received))

    def gather(self, tensor: torch.Tensor, outputs: Sequence[torch.Tensor] | None, dst: int) -> Work:
        if not self._fits(tensor):
            self._agree()
            return self._native.gather(tensor, outputs, dst)
        slots = self._slots(tensor.device)
        sent, _, rows = slots.data(tensor.nbytes, tensor.dtype)
        sent[dst].copy_(_flat(tensor))
        if outputs is None:  # not the destination
            return self._small(slots)
        return self._small(slots, lambda: _copy_rows(outputs, rows))

    def scatter(self, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int) -> Work:
        if not self._fits(tensor):
            self._agree()
            return self._native.scatter(tensor, inputs, src)
        slots = self._slots(tensor.device)
        sent, _, rows = slots.data(tensor.nbytes, tensor.dtype)
        for j, piece in enumerate(inputs or ()):  # inputs: on src only
            sent[j].copy_(_flat(piece))
        return self._small(slots, lambda: _flat(tensor).copy_(rows[src]))

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Work:
        receives = [_bytes_of(t) for t in outputs]
        slots = self._announce("all_to_all", [_bytes_of(t) for t in inputs], receives)
        if slots is None:
            return self._native.all_to_all(outputs, inputs)
        return Work(finish=lambda: self._delivered("all_to_all", slots, receives))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Work:
        fn = "all_to_all_single"
        sends = _bytes_of(input).split([n * _row_bytes(input) for n in input_split_sizes])
        receives = _bytes_of(output).split([n * _row_bytes(output) for n in output_split_sizes])
        slots = self._announce(fn, sends, receives)
        if slots is None:
            return self._native.all_to_all_single(output, input, output_split_sizes, input_split_sizes)
        return Work(finish=lambda: self._delivered(fn, slots, receives))

    def _announce(self, fn: str, sends: Sequence[torch.Tensor], receives: Sequence[torch.Tensor]) -> _Slots | None:
        """The all_to_all exchange: this rank's sizes to every rank, and the data where every
        piece of this rank fits. Waits for it and checks the fingerprints and every pair's
        sizes (every rank raises on the same pair). Returns the slots if every rank's pieces
        travelled in them, None if gloo's all_to_all is to move them."""
        P, start = self._size, _header_bytes(fn, self._size)
        sizes = [t.numel() for t in sends] + [t.numel() for t in receives]
        slots = self._slots(sends[0].device)
        header_fits = start <= self._pool.slot
        if header_fits:
            slots.data(16 * P, torch.int64)[0].copy_(torch.tensor(sizes, dtype=torch.int64))
        if max(sizes) <= capacity(fn, P):
            for row, piece in zip(slots.send, sends):
                row[start : start + piece.numel()].copy_(piece)
        wait_gloo(self._exchange(slots))
        self._verify(slots)
        matrix = slots.data(16 * P, torch.int64)[1].tolist() if header_fits else self._sizes(sizes)
        for sender in range(P):
            for receiver in range(P):
                sent, expected = matrix[sender][receiver], matrix[receiver][P + sender]
                if sent != expected:
                    raise CommMismatchError(
                        f"gpucomm.{fn}: rank {sender} sends {sent} bytes to rank {receiver}, which expects "
                        f"{expected}: the ranks passed different split sizes or tensor sizes"
                    )
        # Every rank holds the same matrix, so every rank reaches the same verdict.
        if max(max(row) for row in matrix) <= capacity(fn, P):
            return slots
        self._pool.give(slots)
        return None

    def _sizes(self, sizes: list[int]) -> list[list[int]]:
        """Every rank's sizes, where they do not fit in a slot (many ranks): a second exchange,
        of a size every rank knows once the fingerprints have matched."""
        mine = torch.tensor(sizes, dtype=torch.int64).repeat(self._size, 1)
        theirs = torch.empty_like(mine)
        wait_gloo(self._pg.alltoall_base(theirs, mine, [], []))
        return theirs.tolist()

    def _delivered(self, fn: str, slots: _Slots, receives: Sequence[torch.Tensor]) -> None:
        start = _header_bytes(fn, self._size)
        for row, target in zip(slots.received, receives):
            target.copy_(row[start : start + target.numel()])
        self._pool.give(slots)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        """gloo's own send: a send is matched by its tag on the receiver, no call is checked."""
        return self._native.send(tensor, dst, tag)  # type: ignore[attr-defined]

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        """gloo's own recv, as :meth:`send`."""
        return self._native.recv(tensor, src, tag)  # type: ignore[attr-defined]

    def barrier(self) -> Work:
        return self._small(self._slots(torch.device("cpu")))


def _copy_rows(outputs: Sequence[torch.Tensor], rows: Sequence[torch.Tensor]) -> None:
    for out, row in zip(outputs, rows):
        _flat(out).copy_(row)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 view (stride 1 even where a size-1 dim had
    another: gpucomm.ops.contract.Region.of)."""
    return tensor.as_strided((tensor.numel(),), (1,)).view(torch.uint8)


def _row_bytes(tensor: torch.Tensor) -> int:
    """Bytes of one index along dim 0 (the unit of all_to_all_single's split sizes)."""
    return math.prod(tensor.shape[1:]) * tensor.element_size()
