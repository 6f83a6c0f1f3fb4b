"""The cuda_ipc workspace on a real GPU: data and flags across processes, several ranks per GPU."""

from __future__ import annotations

import datetime
import os

import numpy as np
import pytest
import torch
from rank_store import rank_store, store_barrier
from spawn import run_ranks

from gpucomm.transport import cuda_ipc_available, open_workspace

_OK, _WHY = cuda_ipc_available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"needs CUDA and CuPy: {_WHY}")

DATA_BYTES = 4099  # odd on purpose
FLAG_COUNT = 7


def _pattern(seed: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(0, 256, (DATA_BYTES,), dtype=torch.uint8, generator=gen)


def _flag_value(writer: int, owner: int) -> int:
    return (writer + 1) << 40 | (owner + 1) << 8 | 0x5A


def _raw_read(addr: int, nbytes: int) -> bytes:
    import cupy

    host = np.empty(nbytes, dtype=np.uint8)
    cupy.cuda.runtime.memcpy(host.ctypes.data, addr, nbytes, cupy.cuda.runtime.memcpyDefault)
    return host.tobytes()


def _rank_cuda_check(rank, world_size, prefix, seed):
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    store = rank_store(rank, world_size)
    ws = open_workspace(
        "cuda_ipc",
        store=store,
        prefix=prefix,
        rank=rank,
        world_size=world_size,
        data_bytes=DATA_BYTES,
        flag_count=FLAG_COUNT,
        device=device,
        timeout=60.0,
    )
    try:
        assert ws.device == device and ws.kind == "cuda_ipc"
        for peer in range(world_size):
            assert ws.data(peer).bytes.device == device
            assert torch.count_nonzero(ws.flags(peer).bytes).item() == 0, f"peer {peer}'s flags not zero"
        store_barrier(store, f"{prefix}checked", rank, world_size)
        ws.data(rank).bytes.copy_(_pattern(seed, rank).to(device))
        for owner in range(world_size):  # writes into every peer's memory through the IPC mapping
            ws.flag(owner, rank).view(torch.int64).fill_(_flag_value(rank, owner))
        torch.cuda.synchronize(device)
        store_barrier(store, f"{prefix}written", rank, world_size)
        for peer in range(world_size):
            expected = _pattern(seed, peer)
            region = ws.data(peer)
            assert torch.equal(region.bytes.cpu(), expected), f"rank {rank}: peer {peer}'s data (tensor view)"
            assert _raw_read(region.addr, region.nbytes) == expected.numpy().tobytes(), f"peer {peer} (raw)"
        mine = ws.flags(rank, 0, world_size).view(torch.int64).tolist()
        assert mine == [_flag_value(w, rank) for w in range(world_size)], mine
        store_barrier(store, f"{prefix}read", rank, world_size)  # nobody unmaps while a peer still reads
    finally:
        ws.close()
    ws.close()
    if rank:
        store.set(f"{prefix}done/{rank}", b"1")
    else:  # rank 0 hosts the store server: leave last
        store.wait([f"{prefix}done/{r}" for r in range(1, world_size)], datetime.timedelta(seconds=60))
    return True


@pytest.mark.parametrize("world_size", [2, 4])
def test_cuda_ipc_data_and_flags_several_ranks_per_gpu(world_size):
    prefix = f"cuda/{os.urandom(8).hex()}/"
    seed = int.from_bytes(os.urandom(4), "little")
    assert run_ranks(_rank_cuda_check, world_size, prefix, seed, timeout=240) == [True] * world_size
