"""Symmetric workspaces: every rank's buffer mapped into every rank, over shm or CUDA IPC."""

from gpucomm.transport.cuda_ipc import cuda_ipc_available
from gpucomm.transport.opening import open_workspace
from gpucomm.transport.workspace import Workspace

__all__ = ["TRANSPORTS", "Workspace", "open_workspace", "cuda_ipc_available"]

TRANSPORTS = ("shm", "cuda_ipc")
