"""``Path``: what serves a collective once the communicator has validated it.

Three paths implement it: the workspace engine with the algorithm of one call fixed
(:class:`gpucomm.workspace.path.EnginePath`), gloo (:class:`gpucomm.gloo.fallback.GlooFallback`)
and gloo with every rank's call checked first (:class:`gpucomm.gloo.checked.CheckedGloo`).

Each method starts the collective on tensors already in their wire form (:mod:`gpucomm.comm.dtypes`)
and returns the :class:`~gpucomm.work.Work` that ends with it. Ranks are the communicator's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from gpucomm.reduce_op import ReduceOp
from gpucomm.work import Work

__all__ = ["Path"]


class Path(Protocol):
    """The collectives a path serves, with the arguments of :class:`gpucomm.gloo.fallback.GlooFallback`."""

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp) -> Work: ...

    def reduce(self, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work: ...

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Work: ...

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> Work: ...

    def gather(self, tensor: torch.Tensor, outputs: Sequence[torch.Tensor] | None, dst: int) -> Work: ...

    def scatter(self, tensor: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int) -> Work: ...

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: ReduceOp) -> Work: ...

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Work: ...

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Work: ...

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None,
        input_split_sizes: Sequence[int] | None,
    ) -> Work: ...

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work: ...

    def recv(self, tensor: torch.Tensor, src: int | None, tag: int) -> Work: ...

    def barrier(self) -> Work: ...
