"""gpucomm: GPU-native collective communication with torch.distributed's API.

``import gpucomm as dist`` in place of ``import torch.distributed as dist``.

The public names are listed once, in the ``__all__`` of the modules below; ``__all__`` here is
their union.
"""

from gpucomm import errors as _errors
from gpucomm import fused, language  # noqa: F401  gpucomm.fused.*, gpucomm.language (no Triton imported yet)
from gpucomm.comm.communicator import Communicator
from gpucomm.distributed import collectives as _collectives
from gpucomm.distributed import groups as _groups
from gpucomm.distributed import objects as _objects
from gpucomm.distributed import registration as _registration  # noqa: F401  registers "gpucomm" with torch.distributed
from gpucomm.distributed import torch_names as _torch_names
from gpucomm.distributed import world as _world
from gpucomm.distributed.collectives import *  # noqa: F403
from gpucomm.distributed.groups import *  # noqa: F403
from gpucomm.distributed.objects import *  # noqa: F403
from gpucomm.distributed.torch_names import *  # noqa: F403  torch.distributed's other names
from gpucomm.distributed.world import *  # noqa: F403
from gpucomm.errors import *  # noqa: F403
from gpucomm.reduce_op import ReduceOp
from gpucomm.work import Work

# gpucomm.distributed.torch_names binds ``rendezvous`` to torch's function of that name, over the
# attribute of the submodule gpucomm.comm.rendezvous, which stays importable by its path
# (from gpucomm.comm.rendezvous import ...).

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
    "collect_env",  # noqa: F405  module __getattr__ below imports it on first use
    *_errors.__all__,
    *_world.__all__,
    *_groups.__all__,
    *_collectives.__all__,
    *_objects.__all__,
    *_torch_names.__all__,
]
