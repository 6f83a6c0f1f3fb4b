"""``EnginePath``: the workspace engine with the algorithm of one call fixed.

The communicator asks the engine which algorithm serves a call (:meth:`Engine.serves`), logs it
and checks it against a CUDA graph capture, then runs the call on this path; it has the methods
of :class:`gpucomm.comm.path.Path`, each the engine's own with that algorithm.

``caller`` is the caller's dtype where the tensors travel in another form (int8 reduced as
int32, float8 as float32, 16-bit ints moved as bytes: :mod:`gpucomm.comm.dtypes`): the engine
makes it part of the call's identity (:meth:`Engine.calling`), so that ranks whose dtypes stage
alike still raise CommMismatchError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from gpucomm.reduce_op import ReduceOp
from gpucomm.work import Work
from gpucomm.workspace.engine import Engine

__all__ = ["EnginePath"]


@dataclasses.dataclass(frozen=True)
class EnginePath:
    """``engine``'s collectives, each run with ``algo`` (a name of :mod:`gpucomm.algorithms.select`)."""

    engine: Engine
    algo: str
    caller: str | None = None  # the caller's dtype, where the wire form's differs

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.all_reduce(tensor, op, algo=self.algo)

    def all_reduce_into(self, output: torch.Tensor, tensor: torch.Tensor, op: ReduceOp) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.all_reduce_into(output, tensor, op, algo=self.algo)

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.reduce(tensor, dst, op, algo=self.algo)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.broadcast(tensor, src, algo=self.algo)

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.all_gather(outputs, tensor, algo=self.algo)

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.all_gather_into_tensor(output, tensor, algo=self.algo)

    def gather(self, tensor: torch.Tensor, outputs: Sequence[torch.Tensor] | None, dst: int) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.gather(tensor, outputs, dst, algo=self.algo)

    def scatter(self, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.scatter(tensor, inputs, src, algo=self.algo)

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: ReduceOp) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.reduce_scatter(output, inputs, op, algo=self.algo)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.reduce_scatter_tensor(output, input, op, algo=self.algo)

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.all_to_all(outputs, inputs, algo=self.algo)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None,
    ) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.all_to_all_single(output, input, output_split_sizes, input_split_sizes, algo=self.algo)

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.send(tensor, dst, tag, algo=self.algo)

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.recv(tensor, src, tag, algo=self.algo)

    def barrier(self) -> Work:
        with self.engine.calling(self.caller):
            return self.engine.barrier(algo=self.algo)
