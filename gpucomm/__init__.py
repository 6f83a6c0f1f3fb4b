"""gpucomm: GPU-native collective communication with torch.distributed's API.

``import gpucomm as dist`` in place of ``import torch.distributed as dist``.
"""

from torch.distributed import Backend, FileStore, HashStore, PrefixStore, Store, TCPStore

from gpucomm import fused, language  # noqa: E402, F401  gpucomm.fused.*, gpucomm.language (no Triton imported yet)
from gpucomm.comm.communicator import Communicator
from gpucomm.distributed import backend as _backend  # noqa: E402, F401  registers "gpucomm" with torch.distributed
from gpucomm.distributed.api import (
    GroupMember,
    P2POp,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    check,
    destroy_process_group,
    empty,
    gather,
    get_backend,
    get_default_communicator,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    graph_safe,
    group,
    init_process_group,
    irecv,
    is_available,
    is_gloo_available,
    is_initialized,
    is_nccl_available,
    is_torchelastic_launched,
    isend,
    monitored_barrier,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
    send,
    shrink_group,
    split_group,
    status,
    supports_complex,
)
from gpucomm.distributed.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from gpucomm.distributed.torch_names import *  # noqa: F403  torch.distributed's other names (gpucomm.distributed.torch_names.__all__)
from gpucomm.distributed.torch_names import __all__ as _surface_names
from gpucomm.errors import (
    CommBrokenError,
    CommMismatchError,
    CommTimeoutError,
    GpucommError,
    KernelCompileError,
    NotInitializedError,
    UnsupportedError,
    WorkspaceUnavailableError,
)
from gpucomm.reduce_op import ReduceOp
from gpucomm.work import Work

# gpucomm.distributed.torch_names binds ``rendezvous`` to torch's function of that name, over the attribute of
# the submodule gpucomm.comm.rendezvous, which stays importable by its path (from gpucomm.comm.rendezvous import ...).

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # gpucomm.collect_env comes from gpucomm.env on first use, not at import: `python -m
    # gpucomm.env` runs that module as __main__, which the package must not have imported first.
    if name == "collect_env":
        from gpucomm.env import collect_env

        return collect_env
    raise AttributeError(f"module 'gpucomm' has no attribute {name!r}")


__all__ = [
    "Communicator",
    "ReduceOp",
    "Work",
    "GroupMember",
    "group",
    "P2POp",
    "Backend",
    "Store",
    "TCPStore",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "GpucommError",
    "NotInitializedError",
    "UnsupportedError",
    "WorkspaceUnavailableError",
    "CommTimeoutError",
    "CommMismatchError",
    "CommBrokenError",
    "KernelCompileError",
    "init_process_group",
    "destroy_process_group",
    "empty",
    "is_available",
    "is_initialized",
    "is_gloo_available",
    "is_nccl_available",
    "is_torchelastic_launched",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_default_communicator",
    "status",
    "graph_safe",
    "check",
    "get_process_group_ranks",
    "get_global_rank",
    "get_group_rank",
    "new_group",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "broadcast",
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "all_gather",
    "all_gather_coalesced",
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
    "monitored_barrier",
    "supports_complex",
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "split_group",
    "shrink_group",
    "collect_env",
    *_surface_names,
]
