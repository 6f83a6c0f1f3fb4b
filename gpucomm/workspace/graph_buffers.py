"""Zero copies for captured graphs: an all_reduce or broadcast captured on an ordinary tensor runs in place.

Eagerly, an all_reduce on an ordinary tensor copies it into the workspace's halves and the result
back out (:mod:`gpucomm.algorithms.allreduce`): the peers cannot read the caller's memory. A CUDA
graph replays the same tensors every time, so, as vLLM's custom all-reduce does, a captured call
can instead run the in-place two-shot of symmetric tensors
(:func:`gpucomm.algorithms.allreduce.twoshot_symmetric`) on the users' own tensors, once every
rank has mapped the others' memory:

1. **At capture**, inside ``gpucomm.graph_capture()`` (outside it a captured call keeps the copy
   path), :meth:`CapturedBuffers.launch`, from the executor while the caller's stream captures:
   the call's allocation is recorded (:mod:`gpucomm.workspace.graph_segments`: the caching
   allocator's segment and offset, on the CPU the /dev/shm file's). The ranks agree through the
   store, host-side only, whether every one can share its segment and whether their addresses
   sit alike modulo 16 bytes (the launch's access width is fixed at capture). Where all can, the
   in-place program is built with placeholder addresses for the peers' tensors, and its launch
   is captured: the kernel reads every operand address from its operand table, in device
   memory. Where one cannot, the copy path's launch is captured, and with
   ``GPUCOMM_DEBUG=INFO`` each rank says why, per call.
2. **After the capture** (:meth:`CapturedBuffers.register`: ``graph_capture``'s exit, or
   ``Communicator.register_graph_buffers``; every rank, before the first replay): the ranks
   exchange, once, the handle and offset of every captured call's segment; each opens each peer
   segment once (keyed by its handle), and the operand tables are filled with the peers'
   addresses. Nothing frozen in the graph depends on them: the graph holds the table's address,
   and the table is written after the capture.
3. **Released** with :meth:`GraphBuffers.release` (pass the graph to ``register_graph_buffers``
   and it runs when the graph is freed), or at the latest when the communicator closes.

The result has the copy path's bits: two-shot folds each slice over the ranks in rank order,
rounded once, as one-shot and two-shot through the halves do; only programs of those two are
replaced (ring and tree round at every step, and keep their own program). A broadcast captured
the same way runs the in-place broadcast of symmetric tensors (the others copy the root's
tensor where it is: :func:`gpucomm.algorithms.symmetric.broadcast`). The other collectives
keep the copy path when captured.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable

import torch

from gpucomm import log
from gpucomm.algorithms import symmetric
from gpucomm.algorithms.allreduce import twoshot_symmetric
from gpucomm.errors import CommMismatchError
from gpucomm.ops.contract import Region
from gpucomm.ops.instruction_set import COPY, REDUCE, SYNC
from gpucomm.ops.program import Builder, Program, Ref, Slot, operands
from gpucomm.transport.heap_open import agree
from gpucomm.workspace.graph_segments import Allocation, OpenedSegments, locate

__all__ = ["CapturedBuffers", "GraphBuffers", "IN_PLACE_ALGOS", "staged_copies"]

# The algorithms whose bits the in-place two-shot reproduces (module docstring); the model's
# captured rows (bench/model.py) read it.
IN_PLACE_ALGOS = ("oneshot", "twoshot")
# Placeholder bases of the peers' tensors while their addresses are unknown: far above any
# user-space address (47 bits on x86-64 and Arm), so that a placeholder never names real memory,
# and 16-byte aligned, so that the launch's access width is set by the real addresses' residues.
_TOKEN_SHIFT = 52


# The executor's operand table of a program on the call's buffers
# (gpucomm.workspace.device_executor.operand_rows, which builds on this module and passes it).
Rows = Callable[[Program, tuple[int, ...]], list[list[int]]]


def _token(peer: int) -> int:
    return (0x100 + peer) << _TOKEN_SHIFT


def staged_copies(program: Program) -> int:
    """COPY and REDUCE operands of ``program`` in the workspace's halves: a copy-in, a copy-out or
    a fold staged there. 0 for a program that works on the users' tensors alone."""
    count = 0
    for ins in program.instructions:
        if ins[0] == SYNC:
            continue
        count += sum(isinstance(r, Slot) for r in operands(ins))
    return count


class _Captured:
    """One captured call in place: its program, binding, allocation and deferred tables."""

    def __init__(
        self, program: Program, addr: int, allocation: Allocation, bound: dict, deferred: list, rows: Rows
    ) -> None:
        self.program, self.addr, self.allocation = program, addr, allocation
        self.bound, self.deferred, self.rows = bound, deferred, rows

    def fill(self, peers: list[int]) -> None:
        """Write the operand table with ``peers`` (each rank's tensor, at its address in this process)."""
        for device_table, host_table in self.deferred:  # the instruction table, on a GPU
            device_table.copy_(host_table)
        rows = self.rows(self.program, (self.addr,))
        for row in rows:
            p = row[2] >> _TOKEN_SHIFT
            if row[0] == -1 and p >= 0x100:
                row[2] = peers[p - 0x100] + row[2] - _token(p - 0x100)
        if rows:  # (a broadcast's root moves nothing: its table is the executor's placeholder row)
            self.bound["operands"].copy_(torch.tensor(rows, dtype=torch.int64).reshape(-1))


class GraphBuffers:
    """The peer segments one graph's captured calls read, and their tables; :meth:`release` lets them go."""

    def __init__(self, segments: OpenedSegments, handles: list[bytes], calls: list[_Captured]) -> None:
        self.segments, self.handles, self.calls = segments, handles, calls

    def release(self) -> None:
        """Let this graph's peer segments go (each closes with its last graph): the graph must not
        be replayed after this. Idempotent."""
        handles, self.handles, self.calls = self.handles, [], []
        for handle in handles:
            self.segments.drop(handle)


class CapturedBuffers:
    """The captured in-place calls of one executor, and the graphs registered so far."""

    def __init__(self, executor: object, rows: Rows) -> None:
        self.executor, self.rows = executor, rows
        engine = executor.engine  # type: ignore[attr-defined]
        self.engine = engine
        self._pending: list[_Captured] = []  # one per captured call, in call order on every rank
        self._registered: list[GraphBuffers] = []
        self.segments = OpenedSegments()  # shared by the graphs: each peer segment opened once
        self._calls = 0  # captured calls considered, the same count on every rank
        self._rounds = 0  # registrations so far
        self.copy_path_calls = 0  # captured calls left on the copy path (the tests count them)
        # Inside Communicator.graph_capture only: a graph captured without it replays the copy path,
        # as before, with nothing to register (its replays need no call of gpucomm first).
        self.enabled = 0

    def launch(self, program: Program, addrs: tuple[int, ...]) -> dict | None:
        """While a graph captures: the binding of the in-place program that replaces ``program`` on
        the buffer at ``addrs``, or None where the copy path's own launch is captured."""
        plan = program.cache.get("inplace")
        if not self.enabled or plan is None or len(addrs) != 1 or any(_refs(program)):
            return None  # a collective with no in-place form here, or one on symmetric tensors (in place already)
        fn, dtype, numel, op_or_root, algo = plan
        if fn == "all_reduce" and algo not in IN_PLACE_ALGOS:
            return None
        engine = self.engine
        allocation = locate(addrs[0], engine.device)
        mine = f"0 {allocation.reason}" if allocation.reason else f"1 {addrs[0] % 16}"
        seq, self._calls = self._calls, self._calls + 1
        prefix = f"{engine.graph_prefix}c{seq}/"
        everyone = agree(engine._store, prefix, engine.rank, engine.world_size, engine.timeout, mine)
        why = _why_not(everyone, engine.members)
        if why:
            self.copy_path_calls += 1
            log.logger.info(
                f"gpucomm[rank {engine.comm_rank}]: {fn} bytes={numel * dtype.itemsize} captured with the "
                f"copy path (copy-in and copy-out through the workspace): {why}"
            )
            return None
        inplace = self._inplace(program, addrs[0], dtype, numel, op_or_root)
        bound, deferred = self.executor.bind_deferred(inplace, addrs)  # type: ignore[attr-defined]
        # A program and table per call, even for the same tensor twice: another rank may pass two.
        self._pending.append(_Captured(inplace, addrs[0], allocation, bound, deferred, self.rows))
        log.logger.info(
            f"gpucomm[rank {engine.comm_rank}]: {fn} bytes={numel * dtype.itemsize} captured in place on the "
            f"caller's tensor (no copy-in or copy-out); registered when graph_capture() ends"
        )
        return bound

    def _inplace(self, program: Program, addr: int, dtype: torch.dtype, numel: int, op_or_root: object) -> Program:
        """The in-place form of ``program`` on the tensor at ``addr``, the peers' tensors at placeholders:
        all_reduce's two-shot (``op_or_root`` its op), broadcast's copy from the root (its root)."""
        engine = self.engine
        tensor = Region.alias(addr, numel * dtype.itemsize, engine.device).view(dtype)
        bases = [_token(p) for p in range(engine.world_size)]
        bases[engine.rank] = addr
        fields = ("graph", program.fingerprint, *program.identity)
        b = Builder(
            engine.rank,
            engine.world_size,
            engine.half_bytes,
            program.name,
            fields,
            program.root,
            args=[Region.of(tensor)],
            heap=bases,
        )
        if program.name == "broadcast":
            symmetric.broadcast(b, tensor, op_or_root)  # type: ignore[arg-type]
        else:
            twoshot_symmetric(b, tensor, op_or_root)  # type: ignore[arg-type]
        inplace = b.finish()
        inplace.captured = True
        return inplace

    def register(self, graph: object = None) -> GraphBuffers:
        """Exchange the handles of the segments captured since the last registration, open them,
        fill the tables (module docstring, step 2). Collective: every local rank calls it."""
        engine = self.engine
        calls, self._pending = self._pending, []
        handles: dict[tuple, str] = {}  # one handle per own segment (CUDA opens an allocation once)
        mine = json.dumps([[_own_handle(c.allocation, handles), c.allocation.offset] for c in calls])
        prefix = f"{engine.graph_prefix}r{self._rounds}/"
        self._rounds += 1
        answers = agree(engine._store, prefix, engine.rank, engine.world_size, engine.timeout, mine)
        everyone = [json.loads(answer) for answer in answers]
        counts = [len(theirs) for theirs in everyone]
        if len(set(counts)) != 1:
            raise CommMismatchError(
                f"gpucomm.register_graph_buffers: the ranks captured different numbers of in-place calls "
                f"since their last registration: expected {counts[engine.rank]} on every rank, got {counts}",
                op="register_graph_buffers",
                epoch=None,
                rank=engine.comm_rank,
                peers=[engine.members[p] for p, n in enumerate(counts) if n != counts[engine.rank]],
            )
        taken: dict[bytes, int] = {}  # this graph's peer segments, each taken once
        for i, call in enumerate(calls):
            peers = []
            for p, theirs in enumerate(everyone):
                if p == engine.rank:
                    peers.append(call.addr)
                    continue
                handle = bytes.fromhex(theirs[i][0])
                if handle not in taken:
                    taken[handle] = self.segments.take(handle)
                peers.append(taken[handle] + theirs[i][1])
            call.fill(peers)
        buffers = GraphBuffers(self.segments, list(taken), calls)
        self._registered.append(buffers)
        if graph is not None:
            try:
                weakref.finalize(graph, buffers.release)
            except TypeError as exc:
                buffers.release()
                raise TypeError(
                    f"gpucomm.register_graph_buffers: graph must be an object its segments can live as long as "
                    f"(a torch.cuda.CUDAGraph, weakly referenced), got {type(graph).__name__}"
                ) from exc
        return buffers

    def discard(self) -> None:
        """Forget the calls captured since the last registration (their capture failed)."""
        self._pending = []

    def release(self) -> None:
        """Release every graph's segments (the communicator closes)."""
        registered, self._registered = self._registered, []
        for buffers in registered:
            buffers.release()
        self.segments.release()
        self._pending = []


def _own_handle(allocation: Allocation, handles: dict[tuple, str]) -> str:
    """The handle of this rank's segment of ``allocation``, taken once per segment."""
    key = (allocation.kind, allocation.base, allocation.name)
    if key not in handles:
        handles[key] = allocation.handle().hex()
    return handles[key]


def _refs(program: Program) -> list[bool]:
    return [isinstance(r, Ref) for ins in program.instructions if ins[0] in (COPY, REDUCE) for r in operands(ins)]


def _why_not(everyone: list[str], members: list[int]) -> str:
    """Why the ranks' answers (``"1 <addr % 16>"`` or ``"0 <reason>"``) keep the copy path; "" if none."""
    for p, answer in enumerate(everyone):
        if answer.startswith("0 "):
            return f"rank {members[p]}'s tensor cannot be shared: {answer[2:]}"
    residues = {answer.split()[1] for answer in everyone}
    if len(residues) > 1:
        return f"the ranks' tensors sit at different addresses modulo 16 bytes ({sorted(residues)})"
    return ""
