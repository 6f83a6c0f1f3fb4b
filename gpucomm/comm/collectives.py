"""The collectives of a communicator: each checks its arguments and builds its :class:`Call`.

Each method validates the caller's tensors before anything moves, puts them in their wire form
and hands the route (:mod:`gpucomm.comm.route`) a :class:`~gpucomm.comm.call.Call` that says
which :class:`~gpucomm.comm.path.Path` method serves it. Ranks (src, dst, root, peer) are ranks
of the communicator. All ranks of the group must call each collective, in the same order.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from gpucomm.comm import dtypes, reduce_into
from gpucomm.comm.call import Call, sent_as
from gpucomm.comm.lazy_views import is_lazy, resolving
from gpucomm.comm.route import Router
from gpucomm.comm.validation import (
    check_numel,
    check_rank,
    check_same,
    check_splits,
    check_tensor,
    check_tensor_list,
    separate,
)
from gpucomm.errors import CommTimeoutError
from gpucomm.reduce_op import ReduceOp, as_reduce_op, premul_factor
from gpucomm.work import Work
from gpucomm.workspace.repeat import Repeats

__all__ = ["Collectives"]


class Collectives(Router):
    """torch.distributed's collectives on one communicator (a base of
    :class:`gpucomm.comm.communicator.Communicator`, which owns the state they read)."""

    world_size: int
    device: torch.device | None
    _repeat: Repeats  # blocking all_reduce calls seen before (gpucomm.workspace.repeat)

    # Each method validates the caller's tensors, then hands the path their wire form
    # (gpucomm.comm.dtypes): the tensors themselves for the six native dtypes, byte views for data
    # movement, accumulation-type copies for reductions, written back once at the end.
    # A call's buffers that overlap give the separate-buffer result: what overlaps is staged
    # (gpucomm.comm.validation.separate; docs/reliability.md, "Overlapping buffers"), torch's
    # in-place forms run as they are.
    def all_reduce(self, tensor: torch.Tensor, op: object = ReduceOp.SUM, async_op: bool = False) -> Work | None:
        """Reduce ``tensor`` over all ranks, in place, on every rank.

        All ranks in the group must call this simultaneously.

        Deterministic by contract on the workspace path: each element of the result depends
        only on that element's inputs on every rank, its dtype and op, and the group's layout
        (ranks, and ranks per node); never on the message size, the algorithm (chosen, or forced
        by GPUCOMM_ALGO: only ring and tree leave the contract, and warn), the channels, the
        kernels (Triton, CUDA C++, torch), the order in which ranks arrive, or the run. The
        ranks of a node fold in rank order in the accumulation type (fp32 for 16-bit floats and
        float8) and the result is rounded once; AVG divides once, after the fold; across nodes
        the nodes' folds meet in node order. PREMUL_SUM multiplies each rank's tensor first,
        in its dtype (float8 in fp32), then sums under the same contract. MIN and MAX are
        exact, and so are integer SUM and PRODUCT (wrapping), in any order; a floating-point
        PRODUCT folds in rank order like SUM. The gloo path
        keeps it for calls that fit its checked exchange (gpucomm.gloo.checked) and uses
        gloo's own order beyond. docs/algorithms.md, "Deterministic reductions", has the rule.

        Args:
            tensor: input and output; contiguous, any dtype of :data:`gpucomm.comm.dtypes.REDUCIBLE`.
            op: a ReduceOp (SUM, PRODUCT, MIN, MAX, AVG) or ``ReduceOp.PREMUL_SUM(factor)``.
            async_op: return a Work instead of waiting.
        """
        fn = "all_reduce"
        if not async_op:
            # One call at a time per communicator, in call order (docs/reliability.md, "Threads"):
            # the repeat lookup and launch under the lock the route takes, acquired and released
            # by hand (a with-statement costs twice as much on the hot path).
            lock = self._lock
            lock.acquire()
            try:
                seen = self._repeat.find(tensor, op)
                if seen is not None and self._broken is None and not self._closed and self._progress.idle():
                    self._calls += 1
                    slot = self._flight.enter(self._calls, seen.flight)
                    try:
                        seen.launch()
                    except RuntimeError as err:
                        raise self._translate(fn, self._calls, None)(err) from err
                    self._flight.completed(slot)
                    return None
            finally:
                lock.release()
        if is_lazy(tensor):  # a conjugate or negative view: served on a copy (gpucomm.comm.lazy_views)
            return resolving(Collectives.all_reduce)(self, tensor, op, async_op)
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        rop, scale, name = _operator(op, fn)
        st = dtypes.staged([tensor], rop, fn, scale)
        wire = st.wire[0]
        work = self._route(  # in call order from here (Router._route takes the lock)
            Call(
                fn,
                wire,
                lambda path: path.all_reduce(wire, st.op),
                async_op=async_op,
                finish=st.write_back,
                outputs=[tensor],
                fields={"op": name, **sent_as(tensor, wire)},
            )
        )
        if not async_op and wire is tensor and scale is None:
            with self._lock:
                if not self._progress.idle():
                    # Another thread's asynchronous call runs on the engine now (the progress
                    # thread holds no lock): binding beside it would race; a later repeat learns.
                    return work
                self._repeat.learn(
                    self._engines.get(tensor.device.type), self.config, self._flight, tensor, op, rop, {"op": name}
                )
        return work

    def all_reduce_into(
        self, output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        """``output`` = the reduction of every rank's ``input``; ``input`` is left unchanged.

        The bits of :meth:`all_reduce` on a copy of ``input`` (the same contract). ``output``
        and ``input`` have one shape, dtype and device and are contiguous; ``output`` may be
        ``input`` (then this is :meth:`all_reduce`), but may not share only some of its bytes
        (ValueError, before any data moves). On the workspace, one-shot, two-shot and ring run
        an out-of-place program with no pass more than the in-place one; every other form (the
        gloo path, tree, the small path, multimem, the symmetric two-shot, across nodes, a staged
        dtype, a CUDA graph capture) runs ``output.copy_(input)`` then the in-place call on
        ``output``, in the same stream order (gpucomm.comm.reduce_into; GPUCOMM_DEBUG=DEBUG says
        which).
        """
        return reduce_into.all_reduce_into(self, output, input, op, async_op)

    @resolving
    def reduce(
        self, tensor: torch.Tensor, dst: int = 0, op: object = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        """Reduce ``tensor`` over all ranks into ``tensor`` on ``dst``; other ranks' tensors are unchanged.

        Deterministic by contract, as :meth:`all_reduce`: every element on ``dst`` has the
        bits all_reduce would give it, whichever rank is the root.
        """
        fn = "reduce"
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        check_rank(dst, self.world_size, fn, "dst")
        rop, scale, name = _operator(op, fn)
        st = dtypes.staged([tensor], rop, fn, scale)
        wire = st.wire[0]
        finish = st.write_back if self.rank == dst else None
        return self._route(
            Call(
                fn,
                wire,
                lambda path: path.reduce(wire, dst, st.op),
                async_op=async_op,
                finish=finish,
                outputs=[tensor],
                fields={"op": name, "root": dst, **sent_as(tensor, wire)},
            )
        )

    @resolving
    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Work | None:
        """Copy ``tensor`` of ``src`` into ``tensor`` on every rank."""
        fn = "broadcast"
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        check_rank(src, self.world_size, fn, "src")
        wire = dtypes.as_bytes(tensor)
        return self._route(
            Call(
                fn,
                wire,
                lambda path: path.broadcast(wire, src),
                async_op=async_op,
                outputs=[tensor],
                fields={"root": src, **sent_as(tensor, wire)},
            )
        )

    @resolving
    def all_gather(self, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False) -> Work | None:
        """``tensor_list[i]`` = ``tensor`` of rank i, on every rank.

        In place: ``tensor`` is ``tensor_list[rank]``. Entries that overlap each other are
        received apart and copied in list order (the last listed wins)."""
        fn = "all_gather"
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        outputs = check_tensor_list(tensor_list, self.world_size, fn, "tensor_list", tensor, self.device)
        sep = separate([tensor], outputs, {(0, self.rank): 0})
        wire, wire_outs = dtypes.as_bytes(sep.inputs[0]), [dtypes.as_bytes(t) for t in sep.outputs]
        finish = sep.write_back if sep.staged else None
        return self._route(
            Call(
                fn,
                wire,
                lambda path: path.all_gather(wire_outs, wire),
                async_op=async_op,
                finish=finish,
                outputs=outputs,
                fields=sent_as(tensor, wire),
            )
        )

    @resolving
    def all_gather_into_tensor(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, async_op: bool = False
    ) -> Work | None:
        """``output_tensor`` = the inputs of all ranks concatenated along dim 0 (rank order).

        In place: ``input_tensor`` is this rank's chunk of ``output_tensor``. An input that
        overlaps the output otherwise is copied aside first (the separate-buffer result)."""
        fn = "all_gather_into_tensor"
        self._check_usable(fn)
        check_tensor(input_tensor, fn, "input_tensor", self.device)
        check_tensor(output_tensor, fn, "output_tensor", self.device)
        check_same(output_tensor, input_tensor, fn, "output_tensor")
        check_numel(output_tensor, input_tensor.numel() * self.world_size, fn, "output_tensor (world_size x input)")
        sep = separate(
            [input_tensor], [output_tensor], {(0, 0): self.rank * input_tensor.numel() * input_tensor.element_size()}
        )
        wire_in, wire_out = dtypes.as_bytes(sep.inputs[0]), dtypes.as_bytes(output_tensor)
        return self._route(
            Call(
                fn,
                wire_in,
                lambda path: path.all_gather_into_tensor(wire_out, wire_in),
                async_op=async_op,
                outputs=[output_tensor],
                fields=sent_as(input_tensor, wire_in),
            )
        )

    @resolving
    def gather(
        self, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int = 0, async_op: bool = False
    ) -> Work | None:
        """``gather_list[i]`` on ``dst`` = ``tensor`` of rank i; other ranks pass no list."""
        fn = "gather"
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        check_rank(dst, self.world_size, fn, "dst")
        outputs = None
        if self.rank == dst:
            if gather_list is None:
                raise ValueError(f"gpucomm.{fn}: gather_list is required on the destination rank {dst}")
            outputs = check_tensor_list(gather_list, self.world_size, fn, "gather_list", tensor, self.device)
        elif gather_list:
            raise ValueError(
                f"gpucomm.{fn}: gather_list must be None or empty on rank {self.rank}, which is not the destination "
                f"{dst}"
            )
        sep = separate([tensor], outputs or [], {(0, dst): 0})
        wire, wire_outs = (
            dtypes.as_bytes(sep.inputs[0]),
            None if outputs is None else [dtypes.as_bytes(t) for t in sep.outputs],
        )
        finish = sep.write_back if sep.staged else None
        return self._route(
            Call(
                fn,
                wire,
                lambda path: path.gather(wire, wire_outs, dst),
                async_op=async_op,
                finish=finish,
                outputs=outputs or [],
                fields={"root": dst, **sent_as(tensor, wire)},
            )
        )

    @resolving
    def scatter(
        self, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int = 0, async_op: bool = False
    ) -> Work | None:
        """``tensor`` on rank i = ``scatter_list[i]`` of ``src``."""
        fn = "scatter"
        self._check_usable(fn)
        check_tensor(tensor, fn, device=self.device)
        check_rank(src, self.world_size, fn, "src")
        inputs = None
        if self.rank == src:
            if scatter_list is None:
                raise ValueError(f"gpucomm.{fn}: scatter_list is required on the source rank {src}")
            checked = check_tensor_list(scatter_list, self.world_size, fn, "scatter_list", tensor, self.device)
            inputs = [dtypes.as_bytes(t) for t in separate(checked, [tensor], {(src, 0): 0}).inputs]
        elif scatter_list:
            raise ValueError(
                f"gpucomm.{fn}: scatter_list must be None or empty on rank {self.rank}, which is not the source {src}"
            )
        wire = dtypes.as_bytes(tensor)
        return self._route(
            Call(
                fn,
                wire,
                lambda path: path.scatter(wire, inputs, src),
                async_op=async_op,
                outputs=[tensor],
                fields={"root": src, **sent_as(tensor, wire)},
            )
        )

    @resolving
    def reduce_scatter(
        self, output: torch.Tensor, input_list: list[torch.Tensor], op: object = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        """``output`` on rank i = the reduction over ranks of ``input_list[i]``.

        Deterministic by contract, as :meth:`all_reduce`: every element has the bits that
        all_reduce of the concatenated inputs would give it.
        """
        fn = "reduce_scatter"
        self._check_usable(fn)
        check_tensor(output, fn, "output", self.device)
        inputs = separate(
            check_tensor_list(input_list, self.world_size, fn, "input_list", output, self.device),
            [output],
            {(self.rank, 0): 0},
        ).inputs
        rop, scale, name = _operator(op, fn)
        out, ins = dtypes.staged([output], rop, fn), dtypes.staged(inputs, rop, fn, scale)
        wire = out.wire[0]
        return self._route(
            Call(
                fn,
                wire,
                lambda path: path.reduce_scatter(wire, ins.wire, out.op),
                async_op=async_op,
                finish=out.write_back,
                outputs=[output],
                fields={"op": name, **sent_as(output, wire)},
            )
        )

    @resolving
    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, op: object = ReduceOp.SUM, async_op: bool = False
    ) -> Work | None:
        """``output`` on rank i = the reduction over ranks of chunk i of ``input`` (dim 0).

        Deterministic by contract, as :meth:`all_reduce`: ``output`` on rank i has the bits of
        chunk i of all_reduce's result on ``input``.
        """
        fn = "reduce_scatter_tensor"
        self._check_usable(fn)
        check_tensor(output, fn, "output", self.device)
        check_tensor(input, fn, "input", self.device)
        check_same(input, output, fn, "input")
        check_numel(input, output.numel() * self.world_size, fn, "input (world_size x output)")
        rop, scale, name = _operator(op, fn)
        # In place, the output is this rank's chunk of the input.
        input = separate([input], [output], {(0, 0): -self.rank * output.numel() * output.element_size()}).inputs[0]
        out, inp = dtypes.staged([output], rop, fn), dtypes.staged([input], rop, fn, scale)
        wire, wire_in = out.wire[0], inp.wire[0]
        return self._route(
            Call(
                fn,
                wire,
                lambda path: path.reduce_scatter_tensor(wire, wire_in, out.op),
                async_op=async_op,
                finish=out.write_back,
                outputs=[output],
                fields={"op": name, **sent_as(output, wire)},
            )
        )

    @resolving
    def all_to_all(
        self, output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], async_op: bool = False
    ) -> Work | None:
        """``output_tensor_list[j]`` on rank i = ``input_tensor_list[i]`` of rank j (sizes may differ per pair)."""
        fn = "all_to_all"
        self._check_usable(fn)
        for name, lst in (("output_tensor_list", output_tensor_list), ("input_tensor_list", input_tensor_list)):
            if not isinstance(lst, (list, tuple)) or len(lst) != self.world_size:
                got = len(lst) if isinstance(lst, (list, tuple)) else type(lst).__name__
                raise ValueError(f"gpucomm.{fn}: {name} must hold world_size = {self.world_size} tensors, got {got}")
        outputs = [
            check_tensor(t, fn, f"output_tensor_list[{i}]", self.device) for i, t in enumerate(output_tensor_list)
        ]
        inputs = [check_tensor(t, fn, f"input_tensor_list[{i}]", self.device) for i, t in enumerate(input_tensor_list)]
        for i, t in enumerate(outputs + inputs):
            check_same(t, inputs[0], fn, f"tensor {i} of the lists")
        # In place, this rank's own piece is one tensor in both lists.
        own = {(self.rank, self.rank): 0} if inputs[self.rank].numel() == outputs[self.rank].numel() else {}
        sep = separate(inputs, outputs, own)
        wire_outs, wire_ins = [dtypes.as_bytes(t) for t in sep.outputs], [dtypes.as_bytes(t) for t in sep.inputs]
        finish = sep.write_back if sep.staged else None
        return self._route(
            Call(
                fn,
                wire_ins[0],
                lambda path: path.all_to_all(wire_outs, wire_ins),
                async_op=async_op,
                finish=finish,
                outputs=outputs,
                fields=sent_as(inputs[0], wire_ins[0]),
            )
        )

    @resolving
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        async_op: bool = False,
    ) -> Work | None:
        """Split ``input`` along dim 0, send split j to rank j, concatenate what arrives into ``output``.

        No in-place form: an ``input`` that overlaps ``output`` is copied aside first, so the
        result is the one separate buffers give."""
        fn = "all_to_all_single"
        self._check_usable(fn)
        check_tensor(input, fn, "input", self.device)
        check_tensor(output, fn, "output", self.device)
        check_same(output, input, fn, "output")
        if input.dim() == 0 or output.dim() == 0:
            raise ValueError(
                f"gpucomm.{fn}: input and output need at least one dimension, got shapes {tuple(input.shape)} and "
                f"{tuple(output.shape)}"
            )
        if input.shape[1:] != output.shape[1:]:
            raise ValueError(
                f"gpucomm.{fn}: input and output must agree beyond dim 0, got {tuple(input.shape)} and "
                f"{tuple(output.shape)}"
            )
        in_splits = check_splits(input_split_sizes, self.world_size, input.shape[0], fn, "input_split_sizes")
        out_splits = check_splits(output_split_sizes, self.world_size, output.shape[0], fn, "output_split_sizes")
        # No in-place form (NCCL refuses an aliased alltoall): an input that overlaps the output
        # is copied aside. The byte view keeps dim 0, so the split sizes (rows) stay as they are.
        wire_in, wire_out = dtypes.as_bytes(separate([input], [output]).inputs[0]), dtypes.as_bytes(output)
        return self._route(
            Call(
                fn,
                wire_in,
                lambda path: path.all_to_all_single(wire_out, wire_in, out_splits, in_splits),
                async_op=async_op,
                outputs=[output],
                fields=sent_as(input, wire_in),
            )
        )

    def barrier(self, async_op: bool = False) -> Work | None:
        """Return once every rank has entered the barrier.

        The host waits, on every path: on a GPU the barrier's kernel runs on the stream, and its
        end is waited for on the host (as torch.distributed's barrier does on NCCL), not only
        ordered before the caller's next kernels. With ``async_op=True``, ``wait()`` does that.
        """
        fn = "barrier"
        self._check_usable(fn)
        work = self._route(Call(fn, None, lambda path: path.barrier(), async_op=True, blocking=True))
        if async_op:
            return work
        work.wait()
        return None

    def monitored_barrier(self, timeout: float | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not arrive within ``timeout`` seconds
        (default: the communicator's) in a :class:`CommTimeoutError`; on gloo, as torch's is."""
        fn = "monitored_barrier"
        self._check_usable(fn)
        seconds = self.timeout if timeout is None else timeout
        try:
            self._fallback.monitored_barrier(seconds, wait_all_ranks)
        except RuntimeError as err:
            text = str(err)
            # gloo on rank 0: "[Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 2000 ms";
            # the other ranks hear only that rank 0 failed them.
            found = re.search(r"Ranks? ([\d, ]+) failed to pass", text)
            missing = [int(r) for r in re.findall(r"\d+", found.group(1))] if found else [0]
            raise CommTimeoutError(
                fn, None, self.rank, missing, seconds, detail=f"gloo: {text.splitlines()[0]}"
            ) from err


def _operator(op: object, fn: str) -> tuple[ReduceOp, float | None, str]:
    """The operator a path applies, the PREMUL_SUM factor (or None) and the name to log."""
    scale = premul_factor(op, fn)
    if scale is not None:
        return ReduceOp.SUM, scale, "PREMUL_SUM"
    rop = as_reduce_op(op, fn)
    return rop, None, rop.name
