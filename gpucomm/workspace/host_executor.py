"""``HostExecutor``: runs programs step by step from the host, with the torch reference kernels.

It is the numerical reference of the program kernels, and the CPU path over shared memory.
Copies and reductions are torch ops on views of the workspace; a SYNC is a release store into
each peer's flag and a bounded acquire-poll of this rank's flags. The epoch lives on the host
(one channel: the host is one thread).

Waits raise at once, on the rank that waited: :class:`CommTimeoutError` naming the ranks still
missing at the deadline, or :class:`CommMismatchError` when a peer's flag carries this epoch
with another call's fingerprint, or identity words beside it that name another call
(gpucomm.ops.program, "Identity"). While sends or receives are pending, a wait moves the
mailboxes now and then, so that a rank blocked in a collective still feeds a peer's recv.

Each program is bound once per half parity: its operands resolved to tensor views, its
reductions given their accumulation buffers and its flags their addresses, so that a repeated
call costs no more than the copies, the in-place folds and the flag traffic.

How a wait spends its time (:class:`Backoff`):

1. It spins for a few dozen microseconds: a peer on a core of its own arrives that fast, and a
   sleep would cost tens of microseconds more. No spinning at all when ranks outnumber the cores.
2. It yields the core between polls: the peer it waits for may need that very core, whether our
   ranks or other processes crowd it. On the 2-core CI machine (2 ranks, two-shot all_reduce of
   512 KiB, medians of 8 alternating rounds): 127 us with yielding and 127 us spinning
   throughout, quiet; 124 against 127 us with two busy processes beside.
3. Once a wait has lasted a while (a peer busy with other work), it sleeps in steps that grow
   with the time waited, so that the latency the sleeps add stays a small share of the wait.
4. Once it has lasted half a second, it looks now and then whether a peer it waits for is gone
   (its process dead, on this host): then it raises :class:`PeerLostError` naming it, without
   waiting out the timeout (gpucomm.reliability.lost says when it looks, and what a look costs).
"""

from __future__ import annotations

import collections
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from gpucomm.errors import CommMismatchError, CommTimeoutError
from gpucomm.ops import host_atomics
from gpucomm.ops.contract import Region
from gpucomm.ops.instruction_set import IDENT_BITS, IDENT_TAG_MASK, IDENT_WORDS
from gpucomm.ops.program import COPY, FP_BITS, REDUCE, Arg, Program, Ref, Slot, operands, resolve
from gpucomm.ops.reference import fold_into, needs_scratch
from gpucomm.reduce_op import ReduceOp, accumulation_dtype
from gpucomm.reliability.host_threads import ThreadFit, pieces
from gpucomm.reliability.lost import FIRST_LOOK_S, LOOK_EVERY_S, LostPeers
from gpucomm.roles import FlagWords, NodeWorkspace

__all__ = ["HostExecutor", "HostEngine", "Backoff"]

_FP_MASK = (1 << FP_BITS) - 1
# Spinning (no pause between polls) lasts this long at most: a peer with a core of its own
# arrives within it.
_SPIN_ONLY_S = 50e-6
# A wait that has lasted this long is waiting for a busy peer, not for the interconnect: it
# starts sleeping, each sleep a _SLEEP_SHARE of the time waited so far (at most _MAX_SLEEP_S),
# which bounds the latency the sleeps add to that share.
_SPIN_S = 2e-3
_SLEEP_SHARE = 0.05
_MAX_SLEEP_S = 1e-3
# Bindings (a program's steps on one call's buffers, per half parity) kept per program: a loop
# on the same buffers alternates between two; one passing fresh tensors rebinds each call. Each
# binding kept pins about 4 MiB of malloc's heap in a loop of fresh 4 MiB tensors (2 ranks, 350
# all_reduce calls on the 2-core VM, the resident set levels off after the first 50 calls: +16
# MiB keeping 2, +24 MiB keeping 4, +68 MiB keeping 8), so keep few: two buffer sets in turn.
_BINDINGS = 4
# While sends or receives are pending, a wait moves the mailboxes every this many polls.
_PROGRESS_POLLS = 64

Step = Callable[[], None]


class Backoff:
    """What a host wait does between two polls (module docstring).

    Args:
        ranks_here: ranks of the workspace on this host.
        cores: cores this process may run on (default: its affinity mask).
    """

    def __init__(self, ranks_here: int, cores: int | None = None) -> None:
        self.cores = len(os.sched_getaffinity(0)) if cores is None else cores
        self.oversubscribed = ranks_here > self.cores

    def __call__(self, waited_s: float) -> None:
        if waited_s > _SPIN_S:
            time.sleep(min(_MAX_SLEEP_S, waited_s * _SLEEP_SHARE))
        elif self.oversubscribed or waited_s > _SPIN_ONLY_S:
            os.sched_yield()


@runtime_checkable
class Mail(Protocol):
    """The send/recv mailboxes (:class:`gpucomm.algorithms.p2p.Mailboxes`), as a wait drives them.

    A wait moves their pieces while it polls, so that a rank blocked in a collective still feeds a
    peer's recv.
    """

    def busy(self) -> bool: ...

    def progress(self) -> bool: ...  # never blocks; True if a piece moved


@runtime_checkable
class HostEngine(NodeWorkspace, Protocol):
    """What this executor reads of its engine (:class:`gpucomm.workspace.engine.Engine`).

    The node's workspace, the words of its flag area and its mailboxes.
    """

    @property
    def flags(self) -> FlagWords: ...

    @property
    def mail(self) -> Mail: ...

    lost: LostPeers  # which peers' processes are gone (gpucomm.reliability.lost)


class HostExecutor:
    """Runs the programs of one engine with its (torch) kernels; see the module docstring."""

    def __init__(self, engine: HostEngine) -> None:
        self.engine = engine
        self.kernels = engine.kernels
        self.workspace = engine.workspace
        self.rank = engine.rank
        self.backoff = Backoff(engine.world_size)
        self.fit = ThreadFit(engine.world_size)
        self._host_flags = engine.device.type == "cpu"
        if self._host_flags:
            self._store = host_atomics.raw_store_release()
            self._load = host_atomics.raw_load_acquire()
        self._epoch = 0
        self._program: Program | None = None  # the program being run, for error messages

    def epoch(self) -> int:
        """Syncs done so far (every channel's epoch: the host runs one)."""
        return self._epoch

    def check(self) -> None:
        """Errors of this executor raise where they happen: nothing is left to report later."""

    def run(self, program: Program, addrs: tuple[int, ...] = ()) -> None:
        """Run ``program`` on the call's buffers at ``addrs`` (see :class:`gpucomm.ops.program.Arg`)."""
        bindings = program.cache.get("host")
        if bindings is None:
            bindings = program.cache["host"] = collections.OrderedDict()
        key = (self._epoch % 2, addrs)
        steps = bindings.get(key)
        if steps is None:
            steps = bindings[key] = self._bind(program, self._epoch % 2, addrs)
            if len(bindings) > _BINDINGS:
                bindings.popitem(last=False)
        self._program = program
        for step in steps:
            step()

    def bind(self, program: Program, addrs: tuple[int, ...]) -> Callable[[], None]:
        """The launch of ``program`` on buffers at ``addrs``: :meth:`run` on them (its steps are
        bound per epoch's parity, so there is nothing to look up once)."""
        return functools.partial(self.run, program, addrs)

    # -- binding ----------------------------------------------------------------------------------
    def _bind(self, program: Program, parity: int, addrs: tuple[int, ...]) -> list[Step]:
        steps: list[Step] = []
        for ins in program.instructions:
            if ins[0] == COPY:
                # One move (operands refuses any other COPY); a carried COPY runs here alone, in order.
                dst, src = operands(ins)
                steps.append(_bound_copy(self._region(dst, parity, addrs), self._region(src, parity, addrs), self.fit))
            elif ins[0] == REDUCE:
                out = self._region(ins[3], parity, addrs)
                srcs = [self._region(s, parity, addrs) for s in ins[4]]
                steps.append(
                    _bound_reduce(out, srcs, program.dtype, ReduceOp.AVG if ins[5] else program.op, ins[6], self.fit)
                )
                for also in ins[7:]:  # a second destination: the result, copied after the fold (same bits)
                    steps.append(_bound_copy(self._region(also, parity, addrs), out, self.fit))
            else:
                steps.append(self._bind_sync(program, ins[1], ins[2]))
        return steps

    def _region(self, operand: Arg | Ref | Slot, parity: int, addrs: tuple[int, ...]) -> Region:
        engine = self.engine
        if not isinstance(operand, Slot):
            # An alias, not the caller's tensor: the binding is cached with the program and
            # must not keep the tensor alive (it is used only by calls at these addresses).
            return Region.alias(resolve(operand, addrs), operand.nbytes, engine.device)
        offset = engine.p2p_bytes + (parity + operand.round) % 2 * engine.half_bytes + operand.offset
        return self.workspace.data(operand.peer, offset, operand.nbytes)

    def _bind_sync(self, program: Program, signal: Sequence[int], wait: Sequence[int]) -> Step:
        flags, me = self.engine.flags, self.rank
        at_peers = [self.workspace.flag(p, flags.sync_flag(0, me)) for p in signal]
        mine = [self.workspace.flag(me, flags.sync_flag(0, p)) for p in wait]
        # The identity slots of either epoch parity: mine in each signalled peer's area, each
        # awaited peer's in mine (the host runs channel 0 alone).
        ws = self.workspace
        ids_at_peers = [[ws.flags(p, flags.identity_slot(k, 0, me), IDENT_WORDS) for p in signal] for k in (0, 1)]
        ids_mine = [[ws.flags(me, flags.identity_slot(k, 0, p), IDENT_WORDS) for p in wait] for k in (0, 1)]
        peers = list(wait)
        if not self._host_flags:
            return lambda: self._device_sync(program, at_peers, mine, peers, ids_at_peers, ids_mine)
        store, load = self._store, self._load
        signal_addrs = [f.addr for f in at_peers]
        wait_addrs = [f.addr for f in mine]
        id_signal = [[f.addr for f in slots] for slots in ids_at_peers]
        id_wait = [[f.addr for f in slots] for slots in ids_mine]
        word0, word1 = program.identity

        def sync() -> None:
            self._epoch = epoch = self._epoch + 1
            target = epoch << FP_BITS
            tag = (epoch & IDENT_TAG_MASK) << IDENT_BITS
            w0, w1 = tag | word0, tag | word1
            if signal_addrs:
                value = target | program.fingerprint
                for addr, slot in zip(signal_addrs, id_signal[epoch & 1]):
                    store(slot, w0)  # the identity words first: the flag's release publishes them
                    store(slot + 8, w1)
                    store(addr, value)
            if wait_addrs:
                self._check(program, peers, self._poll(wait_addrs, target, peers))
                for peer, slot in zip(peers, id_wait[epoch & 1]):
                    seen0, seen1 = load(slot), load(slot + 8)
                    # Words of this epoch (its tag) that are not this call's; a later tag: the
                    # peer has moved on, having compared ours (gpucomm/ops/program.py, "Identity").
                    if (seen0 != w0 or seen1 != w1) and (seen0 ^ w0) >> IDENT_BITS == 0 == (seen1 ^ w1) >> IDENT_BITS:
                        self._mismatch(program, peer)

        return sync

    # -- waiting ----------------------------------------------------------------------------------
    def _poll(self, addrs: list[int], target: int, peers: list[int]) -> list[int]:
        """Acquire-poll the flags at ``addrs`` until each is >= ``target``; the values seen.

        Raises :class:`CommTimeoutError` naming the peers still short at the deadline.
        """
        load = self._load
        seen = [load(addr) for addr in addrs]
        pending = [i for i, value in enumerate(seen) if value - target < 0]
        if not pending:
            return seen
        start = time.monotonic()
        deadline = start + self.engine.timeout
        mail, polls, look_at = self.engine.mail, 0, FIRST_LOOK_S
        while True:
            now = time.monotonic()
            if now >= deadline:
                self._timeout([peers[i] for i in pending])
            if now - start >= look_at:  # a slow wait now: is a peer it waits for dead? (step 4)
                look_at = now - start + LOOK_EVERY_S
                self._lost([peers[i] for i in pending], start)
            self.backoff(now - start)
            polls += 1
            if polls % _PROGRESS_POLLS == 0 and mail.busy():
                mail.progress()
            still = []
            for i in pending:
                seen[i] = load(addrs[i])
                if seen[i] - target < 0:
                    still.append(i)
            if not still:
                return seen
            pending = still

    def _device_sync(
        self,
        program: Program,
        at_peers: list[Region],
        mine: list[Region],
        peers: list[int],
        ids_at_peers: list[list[Region]],
        ids_mine: list[list[Region]],
    ) -> None:
        """A SYNC on flags in GPU memory (the torch kernels on the CUDA IPC workspace)."""
        self._epoch += 1
        epoch = self._epoch
        target = epoch << FP_BITS
        tag = (epoch & IDENT_TAG_MASK) << IDENT_BITS
        words = [tag | w for w in program.identity]
        if at_peers:
            mine_words = torch.tensor(words, dtype=torch.int64, device=self.engine.device)
            for slot in ids_at_peers[epoch & 1]:  # before the flags, on the same stream
                slot.view(torch.int64).copy_(mine_words)
            self.kernels.signal(at_peers, target | program.fingerprint)
        if mine:
            start = time.monotonic()
            deadline, until = start + self.engine.timeout, start + FIRST_LOOK_S
            # In slices: between two, a look whether a peer it waits for is dead (module docstring, step 4).
            while (missing := self.kernels.wait(mine, target, min(until, deadline))) and until < deadline:
                self._lost([peers[i] for i in missing], start)
                until = time.monotonic() + LOOK_EVERY_S
            if missing:
                self._timeout([peers[i] for i in missing])
            seen = torch.stack([f.view(torch.int64)[0] for f in mine]).tolist()
            self._check(program, peers, seen)
            for peer, slot in zip(peers, ids_mine[epoch & 1]):
                got = slot.view(torch.int64).tolist()
                tags_now = all((g ^ w) >> IDENT_BITS == 0 for g, w in zip(got, words))
                if tags_now and got != words:
                    self._mismatch(program, peer)

    def _lost(self, peers: list[int], start: float) -> None:
        """Raise :class:`PeerLostError` if one of ``peers`` (local ranks), waited for since
        ``start``, is gone."""
        self.engine.lost.check(self._program.name, self._epoch, peers, start, "the workspace's flag wait")

    def _timeout(self, peers: list[int]) -> None:
        engine = self.engine
        raise CommTimeoutError(
            self._program.name, self._epoch, engine.comm_rank, [engine.members[p] for p in peers], engine.timeout
        )

    def _check(self, program: Program, peers: list[int], seen: list[int]) -> None:
        """A peer at this epoch with another fingerprint called something else."""
        for peer, value in zip(peers, seen):
            if value >> FP_BITS == self._epoch and value & _FP_MASK != program.fingerprint:
                self._mismatch(program, peer)

    def _mismatch(self, program: Program, peer: int) -> None:
        """Rank ``peer``'s flag or identity words at this epoch are another call's."""
        raise CommMismatchError(
            f"gpucomm.{program.name} epoch {self._epoch}: rank {self.engine.comm_rank} and rank "
            f"{self.engine.members[peer]} called different collectives (or sizes, dtypes, ops, roots or "
            f"algorithms) at the same step",
            op=program.name,
            epoch=self._epoch,
            rank=self.engine.comm_rank,
            peers=[self.engine.members[peer]],
        )


def _bound_copy(dst: Region, src: Region, fit: ThreadFit) -> Step:
    d, s = dst.bytes, src.bytes
    if (dst.addr | src.addr | dst.nbytes) % 8 == 0:
        try:  # eight-byte elements where the layout allows: the copy loop moves words, not bytes
            d, s = dst.view(torch.int64), src.view(torch.int64)
        except RuntimeError:  # a view whose storage offset torch cannot reinterpret
            pass
    parts = list(zip(pieces(d), pieces(s)))
    if len(parts) == 1:
        return lambda: d.copy_(s)

    def copy() -> None:
        if not fit.serial():
            d.copy_(s)
            return
        for dp, sp in parts:  # below torch's grain: in this thread alone (gpucomm.reliability.host_threads)
            dp.copy_(sp)

    return copy


def _bound_reduce(
    out: Region, srcs: list[Region], dtype: torch.dtype, op: ReduceOp, divisor: int, fit: ThreadFit
) -> Step:
    target = out.view(dtype)
    views = [s.view(dtype) for s in srcs]
    acc = torch.empty_like(target, dtype=accumulation_dtype(dtype)) if needs_scratch(out, srcs, dtype) else None
    targets = pieces(target)
    if len(targets) == 1:
        return lambda: fold_into(target, views, op, divisor, acc)
    # Piece i of the target, of every source and of the accumulator.
    parts = list(
        zip(targets, zip(*(pieces(v) for v in views)), pieces(acc) if acc is not None else [None] * len(targets))
    )

    def reduce() -> None:
        if not fit.serial():
            fold_into(target, views, op, divisor, acc)
            return
        for t, vs, a in parts:  # below torch's grain: in this thread alone (gpucomm.reliability.host_threads)
            fold_into(t, vs, op, divisor, a)

    return reduce
