"""gpucomm: GPU-native collective communication with torch.distributed's API.

``import gpucomm as dist`` in place of ``import torch.distributed as dist``.
"""

from gpucomm.api import (
    GroupMember,
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    destroy_process_group,
    gather,
    get_default_communicator,
    get_rank,
    get_world_size,
    init_process_group,
    irecv,
    is_initialized,
    isend,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
    send,
)
from gpucomm.communicator import Communicator
from gpucomm.errors import (
    CommBrokenError,
    CommMismatchError,
    CommTimeoutError,
    GpucommError,
    KernelCompileError,
    NotInitializedError,
    UnsupportedError,
)
from gpucomm.reduce_op import ReduceOp
from gpucomm.work import Work

from gpucomm import backend as _backend  # noqa: F401  registers "gpucomm" with torch.distributed

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "ReduceOp",
    "Work",
    "GroupMember",
    "GpucommError",
    "NotInitializedError",
    "UnsupportedError",
    "CommTimeoutError",
    "CommMismatchError",
    "CommBrokenError",
    "KernelCompileError",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "get_default_communicator",
    "new_group",
    "send",
    "recv",
    "isend",
    "irecv",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "barrier",
]
