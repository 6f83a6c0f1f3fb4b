"""A torch.distributed backend named ``gpucomm``: ``torch.distributed.init_process_group("gpucomm")``.

Importing gpucomm registers it. The process group wraps a :class:`gpucomm.Communicator` built on
the store torch hands the creator, so every torch.distributed call (and every call DDP makes from
C++: the initial broadcast, the parameter check, the gradient all-reduces) takes gpucomm's paths:
the workspace for CUDA tensors (and CPU tensors with ``GPUCOMM_TRANSPORT=shm``) where it serves
the collective, gpucomm's own gloo group everywhere else.

Why a ``ProcessGroup`` subclass and not a ``Backend``: torch 2.13's C++ ``Backend`` binds no
constructor, so a Python subclass cannot be built (``TypeError: No constructor defined!``), while
a ``ProcessGroup`` subclass is what ``_new_process_group_helper`` returns as the group itself (it
checks ``issubclass(type(backend_class), ProcessGroup)``), in torch 2.11 and 2.13 alike; the C++
trampoline of ``ProcessGroup`` forwards allreduce, broadcast, allgather, ... to the methods below.

Completion: every method waits for its collective before returning a torch ``Work`` made from a
completed ``torch.futures.Future`` (CUDA-aware where the tensors are on a GPU, so that a waiter's
stream is ordered after the collective's kernels). DDP accepts that; it gives up overlapping a
gloo transfer with the rest of the backward pass until gpucomm's ``Work`` can hand out a Future
of its own (see docs/ddp.md).

Method names: torch 2.13 calls ``all_gather_single``, ``reduce_scatter_single``,
``all_to_all_single`` and their ``*_coalesced`` forms; torch 2.11 calls ``_allgather_base``,
``_reduce_scatter_base``, ``alltoall_base``, ``allgather_into_tensor_coalesced`` and
``reduce_scatter_tensor_coalesced``. Both sets are defined.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from gpucomm.communicator import Communicator
from gpucomm.config import Config
from gpucomm.reduce_op import ReduceOp, as_reduce_op
from gpucomm.rendezvous import rendezvous

__all__ = ["BACKEND_NAME", "ProcessGroupGpucomm"]

BACKEND_NAME = "gpucomm"


class ProcessGroupGpucomm(dist.ProcessGroup):
    """torch.distributed process group served by a gpucomm :class:`Communicator`.

    Built by ``torch.distributed.init_process_group("gpucomm")`` or ``new_group(backend="gpucomm")``;
    ranks in options (``rootRank``) and arguments (``dst``, ``src``) are group ranks, as torch passes
    them to every backend. ``communicator`` is the wrapped Communicator.
    """

    def __init__(self, communicator: Communicator) -> None:
        super().__init__(communicator.rank, communicator.world_size)
        self.communicator = communicator

    # -- identity and life cycle --------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 (the C++ virtual's name)
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def shutdown(self) -> None:
        self.communicator.close()

    def abort(self) -> None:
        self.communicator.close()

    def __repr__(self) -> str:
        return f"ProcessGroupGpucomm(rank={self.communicator.rank}, size={self.communicator.world_size})"

    # -- reductions -----------------------------------------------------------------------------
    def allreduce(self, tensors: torch.Tensor | list[torch.Tensor], opts: object = None) -> dist.Work:
        op = _reduce_op(opts, "allreduce")
        tensors = _as_list(tensors)
        for t in tensors:
            self.communicator.all_reduce(t, op)
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: torch.Tensor | list[torch.Tensor], opts: object = None, op: object = None) -> dist.Work:
        if isinstance(opts, int):  # torch's Python overload reduce(tensor, root, op=SUM)
            root, rop = opts, ReduceOp.SUM if op is None else as_reduce_op(op, "reduce")
        else:
            root, rop = _field(opts, "rootRank", 0), _reduce_op(opts, "reduce")
        tensors = _as_list(tensors)
        for t in tensors:
            self.communicator.reduce(t, root, rop)
        return _done(tensors)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: object = None) -> dist.Work:
        op = _reduce_op(opts, "reduce_scatter")
        for out, inputs in zip(_as_list(output_tensors), input_tensors, strict=True):
            self.communicator.reduce_scatter(out, list(inputs), op)
        return _done(_as_list(output_tensors))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist.Work:
        self.communicator.reduce_scatter_tensor(output, input, _reduce_op(opts, "reduce_scatter_tensor"))
        return _done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: object = None) -> dist.Work:
        for out, inp in zip(outputs, inputs, strict=True):
            self.reduce_scatter_single(out, inp, opts)
        return _done(list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement --------------------------------------------------------------------------
    def broadcast(self, tensors: torch.Tensor | list[torch.Tensor], opts: object = None) -> dist.Work:
        # torch's Python overload broadcast(tensor, root) arrives with an int in place of opts
        root = opts if isinstance(opts, int) else _field(opts, "rootRank", 0)
        tensors = _as_list(tensors)
        for t in tensors:
            self.communicator.broadcast(t, root)
        return _done(tensors)

    def allgather(self, output_tensors: list, input_tensors: torch.Tensor | list[torch.Tensor], opts: object = None) -> dist.Work:
        inputs = _as_list(input_tensors)
        # torch's Python overload allgather(list[Tensor], Tensor) passes one flat output list
        outputs = [output_tensors] if isinstance(input_tensors, torch.Tensor) else output_tensors
        for outs, inp in zip(outputs, inputs, strict=True):
            self.communicator.all_gather(list(outs), inp)
        return _done([t for outs in outputs for t in outs])

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: object = None) -> dist.Work:
        return self.allgather(output_lists, input_list, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist.Work:
        self.communicator.all_gather_into_tensor(output, input)
        return _done([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: object = None) -> dist.Work:
        for out, inp in zip(outputs, inputs, strict=True):
            self.all_gather_single(out, inp, opts)
        return _done(list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        root = _field(opts, "rootRank", 0)
        gather_list = list(output_tensors[0]) if self.communicator.rank == root else None
        self.communicator.gather(_one(input_tensors, "gather"), gather_list, root)
        return _done(gather_list or [])

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: object = None) -> dist.Work:
        root = _field(opts, "rootRank", 0)
        scatter_list = list(input_tensors[0]) if self.communicator.rank == root else None
        out = _one(output_tensors, "scatter")
        self.communicator.scatter(out, scatter_list, root)
        return _done([out])

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        self.communicator.all_to_all(list(output_tensors), list(input_tensors))
        return _done(list(output_tensors))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: object = None,
    ) -> dist.Work:
        # torch passes empty split lists for "equal splits"; the Communicator reads None or [] so
        self.communicator.all_to_all_single(output, input, list(output_split_sizes), list(input_split_sizes))
        return _done([output])

    alltoall_base = all_to_all_single

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        t = _one(tensors, "send")
        self.communicator.send(t, dst, tag)
        return _done([t])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        t = _one(tensors, "recv")
        self.communicator.recv(t, src, tag)
        return _done([t])

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        t = _one(tensors, "recv")
        return _SourceWork(self.communicator.recv(t, None, tag), _future([t]))

    def barrier(self, opts: object = None) -> dist.Work:
        self.communicator.barrier()
        return _done([])


class _SourceWork(dist.Work):
    """A completed receive from any source: ``torch.distributed.recv`` asks it ``_source_rank()``."""

    def __init__(self, source: int, future: torch.futures.Future) -> None:
        super().__init__()
        self._source = source
        self._future = future

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def _source_rank(self) -> int:
        return self._source


# -- helpers ----------------------------------------------------------------------------------
def _as_list(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _one(tensors: Sequence[torch.Tensor], fn: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"gpucomm backend {fn}: expected exactly one tensor per process, got {len(tensors)}")
    return tensors[0]


def _field(opts: object, name: str, default: object) -> object:
    return default if opts is None else getattr(opts, name)


def _reduce_op(opts: object, fn: str) -> ReduceOp:
    """The ReduceOp of an options object, or of a bare op (torch's ``allreduce(tensors, op)`` overload)."""
    if opts is None:
        return ReduceOp.SUM
    op = getattr(opts, "reduceOp", opts)
    # An options object's reduceOp is a ReduceOp *instance*; its RedOpType is what compares by value.
    return as_reduce_op(getattr(op, "op", op), fn)


def _future(tensors: list[torch.Tensor]) -> torch.futures.Future:
    """A Future already holding ``tensors``; on CUDA it records the current streams, so that
    whoever waits on it is ordered after the kernels the collective queued there."""
    devices = sorted({t.device for t in tensors if t.is_cuda}, key=str)
    fut: torch.futures.Future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
    fut.set_result(tensors)
    return fut


def _done(tensors: list[torch.Tensor]) -> dist.Work:
    return _create_work_from_future(_future(tensors))


# -- registration -----------------------------------------------------------------------------
def _create(options: object, backend_options: object = None) -> ProcessGroupGpucomm:
    """torch's creator (``extended_api=True``): a ``_DistributedBackendOptions`` with the group's
    store (already prefixed with its group name), rank, size, timeout and global ranks."""
    rank, size = options.group_rank, options.group_size  # type: ignore[attr-defined]
    # torch always passes a timeout (30 min by default), so an explicit GPUCOMM_TIMEOUT wins over it.
    timeout: datetime.timedelta | None = None if os.environ.get("GPUCOMM_TIMEOUT") else options.timeout  # type: ignore[attr-defined]
    config = Config.from_env(timeout=timeout)
    # rendezvous draws a fresh key prefix in this group's store, so that re-creating the group on
    # a reused store never reads the previous generation's workspace handles.
    rdv = rendezvous(None, rank, size, options.store, config.timeout, fn="init_process_group(backend='gpucomm')")  # type: ignore[attr-defined]
    global_ranks = list(options.global_ranks_in_group) or list(range(size))  # type: ignore[attr-defined]
    comm = Communicator(
        rdv.store,
        rank,
        size,
        prefix=rdv.prefix,
        config=config,
        local_rank=rdv.local_rank,
        local_world_size=min(rdv.local_world_size, size),
        global_ranks=global_ranks,
    )
    return ProcessGroupGpucomm(comm)


def _register() -> None:
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


_register()
