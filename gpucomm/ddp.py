"""DDP communication hooks that reduce gradient buckets with gpucomm.

In the shape of ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``: each hook is
``hook(state, bucket) -> torch.futures.Future[torch.Tensor]`` and is registered with
``ddp_model.register_comm_hook(GpucommState(), hook)``. DDP keeps its own process group (gloo,
NCCL, ...) for the initial broadcast and the parameter check; only the gradient buckets go
through gpucomm.

The state holds the Communicator the buckets go through, made when the state is: gpucomm's
default one if ``gpucomm.init_process_group`` ran, else one built from the torch process group's
own store and ranks (DDP's group, or torch's default group). Building one is collective: every
rank of that group constructs its ``GpucommState`` at the same point, before training.

The hooks average with one ``all_reduce(op=AVG)``, which sums in fp32 for 16-bit tensors and
divides once at the end, on gloo and on the workspace path alike.
"""

# No ``from __future__ import annotations``: DDP compares the hooks' annotations with
# ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects, not strings.
import torch
import torch.distributed as dist

from gpucomm.comm.communicator import Communicator
from gpucomm.comm.rendezvous import rendezvous
from gpucomm.config import Config
from gpucomm.distributed.world import get_default_communicator, is_initialized
from gpucomm.errors import NotInitializedError
from gpucomm.reduce_op import ReduceOp

__all__ = ["GpucommState", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]


class GpucommState:
    """The state the hooks take: the Communicator that reduces the gradient buckets.

    Args:
        process_group: a torch process group (gloo, NCCL, gpucomm, ...) whose members reduce
            together, typically the one DDP was built on. gpucomm builds a Communicator from
            its store and ranks, now, collectively: every member constructs its state here.
            A group of the ``gpucomm`` backend lends its own Communicator.
        comm: a Communicator to use as it is (not with ``process_group``).

    With neither, the state takes gpucomm's default communicator if ``gpucomm.init_process_group``
    ran, else builds one from torch's default group; with no group at all it raises
    :class:`gpucomm.NotInitializedError` here, not at the first backward pass.
    ``close()`` frees a Communicator the state built (a context manager does too).

    Example::
        >>> # xdoctest: +SKIP
        >>> torch.distributed.init_process_group("nccl")
        >>> model = DistributedDataParallel(model, device_ids=[local_rank])
        >>> model.register_comm_hook(GpucommState(model.process_group), allreduce_hook)
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, comm: Communicator | None = None) -> None:
        if process_group is not None and comm is not None:
            raise ValueError("gpucomm.ddp.GpucommState: pass process_group or comm, not both")
        if comm is not None and not isinstance(comm, Communicator):
            raise TypeError(f"gpucomm.ddp.GpucommState: comm must be a gpucomm.Communicator, got {type(comm).__name__}")
        self._owned = False
        if comm is None and process_group is None and is_initialized():
            comm = get_default_communicator()
        if comm is None:
            comm, self._owned = _from_torch_group(process_group)
        self.comm: Communicator = comm

    def close(self) -> None:
        """Free the Communicator this state built (one it was given stays open)."""
        if self._owned:
            self.comm.close()

    def __enter__(self) -> "GpucommState":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _from_torch_group(group: dist.ProcessGroup | None) -> tuple[Communicator, bool]:
    """A Communicator over ``group``'s members (torch's default group for None), built on its
    store; (communicator, whether the caller owns it)."""
    if group is None:
        if not dist.is_initialized():
            raise NotInitializedError(
                "gpucomm.ddp.GpucommState: no process group to reduce over: call gpucomm.init_process_group() or "
                "torch.distributed.init_process_group() first, or pass the DDP model's process_group"
            )
        group = dist.group.WORLD
    lent = getattr(group, "communicator", None)
    if isinstance(lent, Communicator):
        return lent, False
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "gpucomm.ddp.GpucommState: process_group must be a torch.distributed.ProcessGroup, "
            f"got {type(group).__name__}"
        )
    config = Config.from_env()
    store = dist.PrefixStore("gpucomm-hooks/", dist.distributed_c10d._get_process_group_store(group))
    fn = "ddp.GpucommState"
    global_ranks = dist.get_process_group_ranks(group)
    named = None if group.size() == dist.get_world_size() else global_ranks  # the world: one numbering
    rdv = rendezvous(None, group.rank(), group.size(), store, config.timeout, fn=fn, global_ranks=named)
    comm = Communicator(
        rdv.store,
        rdv.rank,
        rdv.world_size,
        prefix=rdv.prefix,
        config=config,
        local_rank=rdv.local_rank,
        local_world_size=min(rdv.local_world_size, rdv.world_size),
        global_ranks=global_ranks,
        fn=fn,
    )
    return comm, True


def _communicator(state: GpucommState | None, hook: str) -> Communicator:
    if state is None:
        return get_default_communicator()
    if not isinstance(state, GpucommState):
        raise TypeError(
            f"gpucomm.ddp.{hook}: state must be a gpucomm.ddp.GpucommState or None, got {type(state).__name__}"
        )
    return state.comm


def _average(
    state: GpucommState | None, bucket: dist.GradBucket, dtype: torch.dtype, hook: str
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s buffer over the ranks, sending it as ``dtype``; the result lands in the buffer."""
    comm = _communicator(state, hook)
    buffer = bucket.buffer()
    wire = buffer.to(dtype)  # the same tensor when dtype is already the buffer's
    # No division before the reduce (torch's hooks divide first to keep fp16 sums from
    # overflowing): the sum is taken in fp32 inside the reduce, so it cannot overflow, and
    # dividing once afterwards saves a rounding in 16 bits.
    work = comm.all_reduce(wire, ReduceOp.AVG, async_op=True)

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        done.value()  # raises the collective's error
        if wire is not buffer:
            buffer.copy_(wire)  # decompress in place, as torch does, to keep peak memory down
        return buffer

    # The Future completes when the all-reduce does (gloo's thread, or the communicator's CUDA
    # stream), so DDP goes on with the backward pass meanwhile.
    return work.get_future().then(decompress)


def allreduce_hook(state: GpucommState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over all ranks with gpucomm's ``all_reduce``.

    Gives the same gradients as DDP without a hook (up to the rounding of dividing after the sum
    instead of before it).

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(GpucommState(ddp_model.process_group), allreduce_hook)
    """
    return _average(state, bucket, bucket.buffer().dtype, "allreduce_hook")


def bf16_compress_hook(state: GpucommState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send the bucket as bfloat16, sum it in fp32 inside the reduce, divide once, write it back.

    torch's ``bf16_compress_hook`` divides in bf16 before sending and sums in bf16 (one rounding per
    addition); here the only roundings are the compression of each rank's gradients and the final
    result's, so the averaged gradients are closer to an fp32 all-reduce (docs/ddp.md has numbers).

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(GpucommState(), bf16_compress_hook)
    """
    return _average(state, bucket, torch.bfloat16, "bf16_compress_hook")


# DDP refuses a hook *named* bf16_compress_hook unless NCCL >= 2.10 is present (it takes it for
# torch's own; see DistributedDataParallel._check_comm_hook). gpucomm's needs no NCCL.
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "gpucomm_bf16_compress_hook"


def fp16_compress_hook(state: GpucommState | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Send the bucket as float16, sum it in fp32 inside the reduce, divide once, write it back.

    Like :func:`bf16_compress_hook` with float16's 11-bit mantissa; values beyond float16's range
    (65504) overflow when compressed, as with torch's ``fp16_compress_hook``.

    Example::
        >>> # xdoctest: +SKIP
        >>> ddp_model.register_comm_hook(GpucommState(), fp16_compress_hook)
    """
    return _average(state, bucket, torch.float16, "fp16_compress_hook")
