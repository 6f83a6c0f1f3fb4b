"""What the GPU tests share: their skip mark, and a rank's GPU and default group on it."""

from __future__ import annotations

import pytest

from gpucomm.transport import cuda_ipc_available

_OK, _WHY = cuda_ipc_available()
NEEDS_CUDA_IPC = pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")


def init_cuda_group(rank: int, kernels: str, timeout: float = 120):
    """This rank's GPU (several ranks may share one) and the default group on it. The timeout is
    long: a rank's first call compiles the program kernel, and its peers wait for it meanwhile."""
    import torch

    import gpucomm

    torch.cuda.set_device(rank % torch.cuda.device_count())
    gpucomm.init_process_group(transport="cuda_ipc", kernels=kernels, timeout=timeout)
    return torch.device("cuda", torch.cuda.current_device())
