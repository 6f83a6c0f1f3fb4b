"""The collectives a workspace engine serves: each builds (or finds) its program and runs it.

Each method has the arguments of :class:`gpucomm.comm.path.Path`'s, plus the algorithm the
engine chose for the call (:meth:`gpucomm.workspace.engine.Engine.serves`); the communicator
reaches them through :class:`gpucomm.workspace.path.EnginePath`. A method returns once every
kernel of the call is issued; the Work it returns is complete, and the communicator adds the
end of its stream on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gpucomm.algorithms import (
    across_nodes,
    allgather,
    allreduce,
    alltoall,
    hierarchical,
    p2p,
    reducescatter,
    rooted,
    select,
    symmetric,
)
from gpucomm.errors import UnsupportedError
from gpucomm.language import layout as device_layout
from gpucomm.language.context import DeviceContext
from gpucomm.ops.contract import Kernels, Region
from gpucomm.ops.device_guard import launching_on
from gpucomm.ops.program import Builder, Program
from gpucomm.reduce_op import ReduceOp
from gpucomm.transport.heap import SymmetricHeap
from gpucomm.work import Work
from gpucomm.workspace import into
from gpucomm.workspace.channels import launch_channels
from gpucomm.workspace.multimem import MultimemAllReduce, exact_in_any_order
from gpucomm.workspace.small import SmallAllReduce
from gpucomm.workspace.stream_order import StreamOrder

__all__ = ["EngineCollectives"]


class EngineCollectives:
    """The collectives of :class:`gpucomm.workspace.engine.Engine` (its base), which owns the
    state they read: the workspace, its programs and executor, the heap and the streams."""

    world_size: int
    members: list[int]
    half_bytes: int
    channels: int
    knob_algo: str
    device: torch.device
    kernels: Kernels
    stream: torch.cuda.Stream | None
    order: StreamOrder | None
    heap: SymmetricHeap | None
    multimem: MultimemAllReduce
    small: SmallAllReduce
    mail: p2p.Mailboxes
    executor: object

    # The engine's own methods that the collectives call.
    program: Callable[..., Program]
    run: Callable[..., None]
    upload: Callable[[torch.Tensor], torch.Tensor]
    published: Callable[[int, int], list[torch.Tensor]]
    local_of: Callable[[int], int]
    on_caller_stream: Callable[[], None]
    device_context: Callable[..., DeviceContext]

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, *, algo: str) -> Work:
        if algo == "hierarchical":
            hierarchical.all_reduce(self, tensor, op)
        else:
            self.bind_all_reduce(tensor, op, algo)()
        return self.completed()

    def all_reduce_into(self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, *, algo: str) -> Work:
        """``output`` = the all_reduce of ``tensor``, which is left as it is (gpucomm.workspace.into)."""
        return into.all_reduce_into(self, output, tensor, op, algo)

    def bind_all_reduce_into(
        self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp, algo: str
    ) -> Callable[[], None] | None:
        """The launch of :meth:`all_reduce_into` (as :meth:`bind_all_reduce`'s), or None where
        ``algo`` has no out-of-place program."""
        return into.bind(self, output, tensor, op, algo)

    def bind_all_reduce(self, tensor: torch.Tensor, op: ReduceOp, algo: str) -> Callable[[], None]:
        """The launch of an all_reduce of ``tensor`` in place with ``op`` and ``algo`` (any but
        ``hierarchical``): it holds the buffer's address and size, never the tensor.

        Calling it runs the all_reduce: on a GPU on the caller's current stream, which it first
        orders after this communicator's launches so far (:mod:`gpucomm.workspace.stream_order`;
        nothing to do where the route has ordered it already). :meth:`all_reduce` calls it once;
        :mod:`gpucomm.workspace.repeat` keeps it and calls it again, so that the first and the
        repeated call run the same code. Raises UnsupportedError where the form ``algo`` names
        cannot serve the call.
        """
        if algo == "oneshot_lang":
            return self._lang_launch(tensor, op)
        if algo == select.SMALL:
            return self.small.bind(tensor, op)
        if algo == "multimem" or self._multimem_by_default(tensor, op, algo):
            launch = self.multimem.bind(tensor, op)
            if self.stream is None:
                return launch
            on_caller = self.on_caller_stream

            def launch_on_caller() -> None:
                on_caller()
                launch()

            return launch_on_caller
        fields, build = self._all_reduce_plan(tensor, op, algo)
        region = Region.of(tensor)
        program = self.program("all_reduce", fields, [region], build)
        # What a CUDA graph capture of this call needs to run it in place (gpucomm.workspace.graph_buffers).
        program.cache.setdefault("inplace", ("all_reduce", tensor.dtype, tensor.numel(), op, algo))
        return self.executor.bind(program, (region.addr,))

    def _lang_launch(self, tensor: torch.Tensor, op: ReduceOp) -> Callable[[], None]:
        """The one-shot all_reduce written with gpucomm.language (kernels/triton/oneshot.py): the
        program kernel's one-shot, bit for bit, as one launch of a kernel of the device API, its
        checks around it (:meth:`bind_all_reduce`)."""
        if self.kernels.name != "triton":
            raise UnsupportedError(
                "gpucomm.all_reduce: GPUCOMM_ALGO=oneshot_lang runs a Triton kernel; "
                f"GPUCOMM_KERNELS={self.kernels.name} runs none"
            )
        from gpucomm._kernels.triton import oneshot

        ctx = self.device_context("all_reduce")
        # The grid follows the size as the program kernel's does (gpucomm.workspace.channels), within the
        # channel slots of the device API.
        nbytes = min(tensor.numel() * tensor.element_size(), ctx.stage_half_bytes)
        channels = launch_channels(nbytes, min(self.channels, device_layout.CHANNEL_SLOTS))
        # Triton's JIT launches on the current device: this engine's, whatever the caller's is.
        launch = launching_on(
            self.device,
            oneshot.prepare(ctx, tensor.data_ptr(), tensor.numel(), tensor.dtype, int(op), self.world_size, channels),
        )
        check, on_cpu = ctx.check, self.stream is None
        to_caller = self.order.to_caller if self.order is not None else None

        def run() -> None:
            check("all_reduce")
            if to_caller is not None:
                to_caller()
            launch()
            if on_cpu:
                check("all_reduce")  # the launch has run: its errors are there now

        return run

    def _multimem_by_default(self, tensor: torch.Tensor, op: ReduceOp, algo: str) -> bool:
        """``auto`` takes the multimem path on a GPU for a symmetric tensor whose fold is exact
        in any order (integer SUM, MIN, MAX), above one-shot's sizes (the model's crossover:
        docs/performance.md), where the switch is there."""
        return (
            self.device.type == "cuda"
            and algo == "twoshot"
            and select.forced_algo("all_reduce", self.knob_algo) == "auto"
            and exact_in_any_order(tensor.dtype, op)
            and not self.multimem.unsupported(tensor, op)
        )

    def symmetric_offset(self, tensor: torch.Tensor) -> int | None:
        """The heap offset of ``tensor`` if it lies in the symmetric heap, else None."""
        heap = self.heap
        return heap.offset(tensor) if heap is not None and heap.contains(tensor) else None

    def _all_reduce_plan(
        self, tensor: torch.Tensor, op: ReduceOp, algo: str
    ) -> tuple[tuple, Callable[[Builder], None]]:
        """The fields and the build of an all_reduce: in place on a symmetric tensor where the
        algorithm has a form that reads the peers' copies (two-shot), else through the halves.
        The heap offset is part of the fields, so that ranks that pass tensors at different
        offsets (or a symmetric tensor against an ordinary one) raise CommMismatchError."""
        offset = self.symmetric_offset(tensor) if algo == "twoshot" else None
        # In place only where it saves SYNCs: a tensor that fits one half moves in one piece
        # with two SYNCs through the halves, against three in place (docs/performance.md:
        # 8 x H100, 64 MiB workspace, in place ahead from 32 MiB, behind at 8 MiB); forced
        # two-shot (GPUCOMM_ALGO) runs in place at any size.
        nbytes = tensor.numel() * tensor.element_size()
        if (
            offset is not None
            and nbytes <= self.half_bytes
            and select.forced_algo("all_reduce", self.knob_algo) != "twoshot"
        ):
            offset = None
        if offset is None:
            return (tensor.dtype, tensor.numel(), op.name, algo), lambda b: allreduce.run(algo, b, tensor, op)
        fields = (tensor.dtype, tensor.numel(), op.name, algo, "symmetric", offset)
        return fields, lambda b: allreduce.twoshot_symmetric(b, tensor, op)

    def _in_place(self, algo: str, nbytes: int, *tensors: torch.Tensor) -> tuple[int, ...] | None:
        """The heap offsets of ``tensors`` (the ones the peers read) where a direct collective
        moving ``nbytes`` runs in place (gpucomm.algorithms.symmetric): all of them symmetric,
        and more bytes than one half (below, one piece through the halves takes one sync, the
        in-place program two)."""
        if algo != "direct" or nbytes <= self.half_bytes:
            return None
        offsets = tuple(self.symmetric_offset(t) for t in tensors)
        return None if None in offsets else offsets

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp, *, algo: str) -> Work:
        if algo == "hierarchical":
            return self._across(across_nodes.reduce, tensor, dst, op)
        root = self.local_of(dst)
        fields = (tensor.dtype, tensor.numel(), op.name, algo)
        build = lambda b: rooted.reduce(algo, b, tensor, root, op)  # noqa: E731
        offsets = self._in_place(algo, tensor.numel() * tensor.element_size(), tensor)
        if offsets is not None:
            fields, build = (*fields, "symmetric", offsets), lambda b: symmetric.reduce(b, tensor, root, op)  # noqa: E731
        self.run("reduce", fields, [Region.of(tensor)], build, root)
        return self.completed()

    def broadcast(self, tensor: torch.Tensor, src: int, *, algo: str) -> Work:
        if algo == "hierarchical":
            return self._across(across_nodes.broadcast, tensor, src)
        root = self.local_of(src)
        fields = (tensor.dtype, tensor.numel(), algo)
        build = lambda b: rooted.broadcast(algo, b, tensor, root)  # noqa: E731
        offsets = self._in_place(algo, tensor.numel() * tensor.element_size(), tensor)
        if offsets is not None:
            fields, build = (*fields, "symmetric", offsets), lambda b: symmetric.broadcast(b, tensor, root)  # noqa: E731
        region = Region.of(tensor)
        program = self.program("broadcast", fields, [region], build, root)
        # What a CUDA graph capture of this call needs to run it in place (gpucomm.workspace.graph_buffers).
        program.cache.setdefault("inplace", ("broadcast", tensor.dtype, tensor.numel(), root, algo))
        self.executor.run(program, (region.addr,))
        return self.completed()

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor, *, algo: str) -> Work:
        if algo == "hierarchical":
            return self._across(across_nodes.all_gather, outputs, tensor)
        mine, outs = Region.of(tensor), [Region.of(t) for t in outputs]
        self.run(
            "all_gather",
            (tensor.dtype, tensor.numel(), algo),
            [mine, *outs],
            lambda b: allgather.run(algo, b, mine, outs),
        )
        return self.completed()

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, *, algo: str) -> Work:
        if algo == "hierarchical":
            return self._across(across_nodes.all_gather_into_tensor, output, tensor)
        mine, whole, size = Region.of(tensor), Region.of(output), tensor.numel() * tensor.element_size()
        outs = [whole.sub(p * size, size) for p in range(self.world_size)]
        fields = (tensor.dtype, tensor.numel(), algo)
        build = lambda b: allgather.run(algo, b, mine, outs)  # noqa: E731
        # In place where the input is symmetric (the peers read it); the output may be any tensor.
        offsets = self._in_place(algo, whole.nbytes, tensor)
        if offsets is not None:
            fields, build = (
                (*fields, "symmetric", offsets),
                lambda b: symmetric.all_gather_into_tensor(b, whole, tensor),
            )  # noqa: E731
        self.run("all_gather_into_tensor", fields, [mine, whole], build)
        return self.completed()

    def gather(self, tensor: torch.Tensor, outputs: Sequence[torch.Tensor] | None, dst: int, *, algo: str) -> Work:
        if algo == "hierarchical":
            return self._across(across_nodes.gather, tensor, outputs, dst)
        root = self.local_of(dst)
        regions = [Region.of(tensor), *(Region.of(t) for t in outputs or ())]
        fields = (tensor.dtype, tensor.numel(), algo)
        self.run("gather", fields, regions, lambda b: rooted.gather(b, tensor, outputs, root), root)
        return self.completed()

    def scatter(self, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int, *, algo: str) -> Work:
        if algo == "hierarchical":
            return self._across(across_nodes.scatter, tensor, inputs, src)
        root = self.local_of(src)
        regions = [Region.of(tensor), *(Region.of(t) for t in inputs or ())]
        fields = (tensor.dtype, tensor.numel(), algo)
        self.run("scatter", fields, regions, lambda b: rooted.scatter(b, tensor, inputs, root), root)
        return self.completed()

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: ReduceOp, *, algo: str) -> Work:
        if algo == "hierarchical":
            return self._across(across_nodes.reduce_scatter, output, inputs, op)
        chunks, out = [Region.of(t) for t in inputs], Region.of(output)
        fields = (output.dtype, output.numel(), op.name, algo)
        self.run(
            "reduce_scatter",
            fields,
            [*chunks, out],
            lambda b: reducescatter.run(algo, b, chunks, out, output.dtype, op),
        )
        return self.completed()

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, *, algo: str) -> Work:
        if algo == "hierarchical":
            return self._across(across_nodes.reduce_scatter_tensor, output, input, op)
        whole, out, size = Region.of(input), Region.of(output), output.numel() * output.element_size()
        chunks = [whole.sub(p * size, size) for p in range(self.world_size)]
        fields = (output.dtype, output.numel(), op.name, algo)
        build = lambda b: reducescatter.run(algo, b, chunks, out, output.dtype, op, source=whole)  # noqa: E731
        # In place where the input is symmetric (the peers read it); the output may be any tensor.
        offsets = self._in_place(algo, whole.nbytes, input)
        if offsets is not None:
            fields, build = (
                (*fields, "symmetric", offsets),
                lambda b: symmetric.reduce_scatter_tensor(b, out, whole, output.dtype, op),
            )  # noqa: E731
        self.run("reduce_scatter_tensor", fields, [whole, out], build)
        return self.completed()

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *, algo: str) -> Work:
        if algo == "hierarchical":
            return self._across(across_nodes.all_to_all, outputs, inputs)
        self._all_to_all(
            "all_to_all", (inputs[0].dtype, algo), [Region.of(t) for t in outputs], [Region.of(t) for t in inputs]
        )
        return self.completed()

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None,
        *,
        algo: str,
    ) -> Work:
        if algo == "hierarchical":
            return self._across(across_nodes.all_to_all_single, output, input, output_split_sizes, input_split_sizes)
        P = self.world_size
        fields = (input.dtype, tuple(input.shape[1:]), algo)
        self._all_to_all(
            "all_to_all_single", fields, _split(output, output_split_sizes, P), _split(input, input_split_sizes, P)
        )
        return self.completed()

    def _all_to_all(self, name: str, fields: tuple, outs: list[Region], ins: list[Region]) -> None:
        """The two programs of :mod:`gpucomm.algorithms.alltoall` and the host's look at the headers."""
        sizes = tuple(r.nbytes for r in ins + outs)
        regions = [*outs, *ins]

        def announce(b: Builder) -> None:
            alltoall.announce(b, outs, ins, b.keep(self.upload(alltoall.size_table(outs, ins, torch.device("cpu")))))

        first = self.program(name, (*fields, "announce"), regions, announce, local=sizes)
        self.executor.run(first, tuple(r.addr for r in regions))
        P = self.world_size
        matrix = torch.stack(self.published(0, 16 * P)).view(torch.int64).tolist()  # one read of all headers
        total = alltoall.rounds(matrix, self.half_bytes, self.members, name)
        self.run(
            name, (*fields, "deliver", total), regions, lambda b: alltoall.deliver(b, outs, ins, total), local=sizes
        )

    def send(self, tensor: torch.Tensor, dst: int, tag: int, *, algo: str) -> Work:
        return self.mail.isend(Region.of(tensor), self.local_of(dst), tag)

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int, *, algo: str) -> Work:
        return self.mail.irecv(Region.of(tensor), None if src is None else self.local_of(src), tag)

    def barrier(self, *, algo: str) -> Work:
        if algo == "hierarchical":
            return self._across(across_nodes.barrier)
        self.run("barrier", (), [], lambda b: b.barrier_all())
        return self.completed()

    def _across(self, compose: Callable[..., None], *args: object) -> Work:
        """Run a collective of a communicator that spans nodes (:mod:`gpucomm.algorithms.across_nodes`):
        the node's flat collectives on this workspace, an inter-node group's between them."""
        compose(self, *args)
        return self.completed()

    def completed(self) -> Work:
        """The Work of a collective whose kernels were all issued (the communicator adds the
        end of its stream on a GPU)."""
        return Work()


def _split(tensor: torch.Tensor, splits: Sequence[int] | None, parts: int) -> list[Region]:
    """The regions of ``tensor``'s dim-0 splits (equal splits when ``splits`` is empty)."""
    rows = tensor.shape[0] if tensor.dim() else 0
    sizes = list(splits) if splits else [rows // parts] * parts
    row_bytes = tensor[0].numel() * tensor.element_size() if rows else 0
    whole, regions, offset = Region.of(tensor), [], 0
    for rows_p in sizes:
        regions.append(whole.sub(offset, rows_p * row_bytes))
        offset += rows_p * row_bytes
    return regions
