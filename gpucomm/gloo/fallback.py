"""The gloo fallback: every collective on a ``ProcessGroupGloo`` built on gpucomm's own store.

It serves CPU tensors by default (and the inter-node stage of hierarchical collectives). Gloo
leaves gaps that gpucomm fills here so that every primitive × op × dtype behaves the same as on
the workspace path:

- 16-bit floats are reduced in fp32 and rounded once at the end (gloo would accumulate in 16
  bits, losing about one bit per doubling of the world size);
- AVG is a SUM followed by one division in the accumulation type; on integers it truncates
  towards zero (gloo refuses AVG on integers).

With ``GPUCOMM_CHECK`` on, the communicator calls the collectives through :meth:`GlooFallback.checked`
(:mod:`gpucomm.gloo.checked`), which compares every rank's fingerprint of the call first.

Ranks here are ranks of this group. Every method returns a :class:`gpucomm.work.Work`.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from gpucomm.errors import CommTimeoutError
from gpucomm.gloo.checked import CheckedGloo, SlotPool
from gpucomm.reduce_op import ReduceOp, accumulation_dtype
from gpucomm.work import Work

__all__ = ["GlooFallback"]

_GLOO_OP = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


class _Staged:
    """Accumulation-dtype stand-ins for the caller's tensors, and how to write results back."""

    def __init__(self, tensors: Sequence[torch.Tensor], op: ReduceOp, divisor: int, private: bool = False) -> None:
        self.originals = list(tensors)
        acc = accumulation_dtype(self.originals[0].dtype) if self.originals else torch.float32
        # private: gloo may use the buffers as scratch space, so hand it copies.
        self.buffers = [t.to(acc, copy=private) for t in self.originals]
        self.op = op
        self.divisor = divisor

    def write_back(self, indices: Sequence[int] | None = None) -> None:
        for i in range(len(self.buffers)) if indices is None else indices:
            result = self.buffers[i]
            if self.op is ReduceOp.AVG:
                # In place: the buffer holds this call's sum and nothing else (a new tensor per
                # bucket, then a copy, was one more pass over every DDP gradient bucket).
                if result.is_floating_point():
                    result.div_(self.divisor)
                else:
                    result.div_(self.divisor, rounding_mode="trunc")
            if result is not self.originals[i]:
                self.originals[i].copy_(result)


class GlooFallback:
    """Collectives of one group on gloo."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout: float,
        fn: str = "Communicator",
        global_ranks: Sequence[int] | None = None,
    ) -> None:
        """Connect the group (collective). ``fn`` (the public call) and ``global_ranks`` (the
        global rank of each rank here; None: the group is the world) name a failure: gloo's own
        is a raw DistStoreError (a timeout) or DistNetworkError (a peer gone) naming a store key."""
        self.rank = rank
        self.world_size = world_size
        try:
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, datetime.timedelta(seconds=timeout))
        except dist.DistError as err:
            # gloo does not say which peer it waited for: each of the others, as far as it tells.
            peers = [r for r in range(world_size) if r != rank]
            reason = str(err).splitlines()[0] if str(err) else ""
            raise CommTimeoutError(
                fn,
                None,
                rank,
                peers,
                timeout,
                detail=f"connecting the gloo group failed ({type(err).__name__}: {reason})",
                global_ranks=list(range(world_size)) if global_ranks is None else global_ranks,
                world=global_ranks is None,
            ) from err
        self._slot_pool = SlotPool(world_size)  # the buffers of checked calls (gpucomm.gloo.checked)

    def checked(self, fingerprint: int, describe: Callable[[list[int]], str]) -> CheckedGloo:
        """These collectives for one call, with every rank's fingerprint of it compared before
        any result is written (:mod:`gpucomm.gloo.checked`); ``describe(ranks)`` words the
        :class:`CommMismatchError` naming the ranks that called something else."""
        return CheckedGloo(self, self.pg, self._slot_pool, self.rank, fingerprint, describe)

    def close(self) -> None:
        """Stop gloo's threads and release the group now, while the interpreter is whole.

        A group left to the interpreter's own teardown can abort the process ("terminate called
        without an active exception"): its threads release tensors, which takes the GIL, and a
        finalising interpreter ends any thread that asks for it. Idempotent.
        """
        pg, self.pg = self.pg, None
        self._slot_pool.clear()
        shutdown = getattr(pg, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # -- reductions -------------------------------------------------------------------------
    def _reducing(
        self,
        tensors: Sequence[torch.Tensor],
        op: ReduceOp,
        launch: Callable[[list[torch.Tensor], dist.ReduceOp], object],
        receives: bool = True,
    ) -> Work:
        staged = _Staged(tensors, op, self.world_size, private=not receives)
        work = launch(staged.buffers, _GLOO_OP[op])
        return Work([work], finish=staged.write_back if receives else None)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        def launch(bufs: list[torch.Tensor], gloo_op: dist.ReduceOp) -> object:
            opts = dist.AllreduceOptions()
            opts.reduceOp = gloo_op
            return self.pg.allreduce(bufs, opts)

        return self._reducing([tensor], op, launch)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work:
        def launch(bufs: list[torch.Tensor], gloo_op: dist.ReduceOp) -> object:
            opts = dist.ReduceOptions()
            opts.reduceOp = gloo_op
            opts.rootRank = dst
            return self.pg.reduce(bufs, opts)

        # Only the root receives the result; gloo scribbles on the other ranks' buffers, which
        # therefore get private copies so that the caller's tensors are left as they were.
        return self._reducing([tensor], op, launch, receives=self.rank == dst)

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: ReduceOp) -> Work:
        staged_out = _Staged([output], op, self.world_size)
        staged_in = _Staged(inputs, ReduceOp.SUM, self.world_size)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _GLOO_OP[op]
        work = self.pg.reduce_scatter(staged_out.buffers, [staged_in.buffers], opts)
        return Work([work], finish=staged_out.write_back)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work:
        staged_out = _Staged([output], op, self.world_size)
        acc = staged_out.buffers[0].dtype
        inp = input if input.dtype == acc else input.to(acc)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _GLOO_OP[op]
        work = self.pg._reduce_scatter_base(staged_out.buffers[0], inp, opts)
        return Work([work], finish=staged_out.write_back)

    # -- data movement ----------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        return Work([self.pg.broadcast([tensor], opts)])

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Work:
        return Work([self.pg.allgather([list(outputs)], [tensor])])

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        return Work([self.pg._allgather_base(output, tensor)])

    def gather(self, tensor: torch.Tensor, outputs: Sequence[torch.Tensor] | None, dst: int) -> Work:
        opts = dist.GatherOptions()
        opts.rootRank = dst
        lists = [list(outputs)] if self.rank == dst and outputs is not None else []
        return Work([self.pg.gather(lists, [tensor], opts)])

    def scatter(self, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int) -> Work:
        opts = dist.ScatterOptions()
        opts.rootRank = src
        lists = [list(inputs)] if self.rank == src and inputs is not None else []
        return Work([self.pg.scatter([tensor], lists, opts)])

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Work:
        # gloo's list all_to_all wants equal sizes; torch.distributed's allows any: go through
        # one flat exchange with split sizes and copy the pieces out.
        flat_in = torch.cat([t.reshape(-1) for t in inputs])
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype, device=flat_in.device)
        out_splits = [t.numel() for t in outputs]
        work = self.pg.alltoall_base(flat_out, flat_in, out_splits, [t.numel() for t in inputs])

        def finish() -> None:
            for out, piece in zip(outputs, flat_out.split(out_splits)):
                out.copy_(piece.view(out.shape))

        return Work([work], finish=finish)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None,
    ) -> Work:
        return Work(
            [self.pg.alltoall_base(output, input, list(output_split_sizes or []), list(input_split_sizes or []))]
        )

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        return Work([self.pg.send([tensor], dst, tag)])

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        if src is not None:
            return Work([self.pg.recv([tensor], src, tag)], source=src)
        gloo_work = self.pg.recv_anysource([tensor], tag)

        def learn_source() -> None:  # the sender is known once gloo's work has ended
            work.source = gloo_work._source_rank()

        work = Work([gloo_work], finish=learn_source)
        return work

    def barrier(self) -> Work:
        return Work([self.pg.barrier(dist.BarrierOptions())])

    def monitored_barrier(self, timeout: float, wait_all_ranks: bool) -> None:
        """gloo's barrier that reports the ranks missing after ``timeout`` seconds (rank 0
        collects; every rank raises)."""
        self.pg.monitored_barrier(datetime.timedelta(seconds=timeout), wait_all_ranks=wait_all_ranks)
