"""gpucomm.fused: collectives fused with the computation around them, one kernel where it can be.

Built on gpucomm.language (the device API). Every function takes an optional ``group`` like
every collective (None: the default group), and all ranks of the group must call it
simultaneously, with tensors of the same shapes and dtypes.

- :func:`all_reduce_residual_rmsnorm`: all_reduce, residual add and RMSNorm in one kernel, as
  tensor-parallel decoders use them; bit for bit the unfused :func:`gpucomm.all_reduce` followed
  by :func:`residual_rmsnorm`.
- :func:`all_gather_matmul`: the gathered shards times a matrix, the gather overlapped with the
  matmul (asynchronous tensor parallelism) in two launches: the push beside the own shard's
  tiles, then the other shards' tiles.
- :func:`recover`: make the fused ops usable again after one timed out (a collective).
"""

from gpucomm.fused._group import recover
from gpucomm.fused._matmul import all_gather_matmul
from gpucomm.fused._norm import all_reduce_residual_rmsnorm, residual_rmsnorm

__all__ = ["all_reduce_residual_rmsnorm", "residual_rmsnorm", "all_gather_matmul", "recover"]
