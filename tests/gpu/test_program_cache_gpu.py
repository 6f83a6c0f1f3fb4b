"""The program cache and CUDA graphs, the halves only a GPU shows (the CPU halves:
tests/workspace/test_program_cache.py).

- Peer views alias: every view of a peer's cuda_ipc buffer has the peer's address as its
  ``data_ptr()`` and sees the peer's writes (a copy would show stale bytes forever).
- A program a CUDA graph captured outlives the program cache: the graph replays correctly after
  more call shapes than the cache holds have run eagerly.
- A timeout inside a replayed graph is not silent: ``gpucomm.check()``, the next eager call and
  ``Work.wait()`` raise it.
- A wait's timeout is decided once per block: every channel's record agrees (the kernel half of
  this is in kernels/triton/program.py).

Skipped without CUDA and CuPy.
"""

from __future__ import annotations

import pytest
from cuda_group import NEEDS_CUDA_IPC, init_cuda_group
from spawn import run_ranks

pytestmark = NEEDS_CUDA_IPC

KERNELS = ("triton", "cuda")


def _peer_views_alias(rank: int, world_size: int) -> list[str]:
    import torch

    import gpucomm

    init_cuda_group(rank, "triton")
    engine = gpucomm.get_default_communicator()._engines["cuda"]
    ws = engine.workspace
    problems = []
    for p in range(world_size):
        region = ws.data(p, 0, 16)
        if region.bytes.data_ptr() != region.addr:
            problems.append(f"view of rank {p} at {region.bytes.data_ptr():#x}, buffer at {region.addr:#x}")
    # Each rank writes its rank into the first bytes of its own data area; after a barrier every
    # rank reads every peer's through its view.
    ws.data(rank, 0, 8).view(torch.int64).fill_(100 + rank)
    torch.cuda.synchronize()
    gpucomm.barrier()
    seen = [int(ws.data(p, 0, 8).view(torch.int64).item()) for p in range(world_size)]
    if seen != [100 + p for p in range(world_size)]:
        problems.append(f"read {seen} through the views")
    gpucomm.barrier()
    gpucomm.destroy_process_group()
    return problems


def test_peer_views_alias_the_peers_memory():
    assert run_ranks(_peer_views_alias, 2, timeout=300) == [[], []]


def _graph_outlives_the_cache(rank: int, world_size: int, kernels: str) -> list[float]:
    import torch

    import gpucomm
    import gpucomm.workspace.engine as engine_module

    device = init_cuda_group(rank, kernels)
    t = torch.zeros(256, device=device)
    gpucomm.all_reduce(t)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpucomm.all_reduce(t)
    for n in range(1, engine_module._PROGRAM_CACHE + 20):  # evicts every program it can
        gpucomm.all_reduce(torch.ones(n + 256, device=device))
    torch.cuda.synchronize()
    results = []
    for step in range(3):
        t.fill_(rank + step)
        graph.replay()
        torch.cuda.synchronize()
        results.append(t[0].item())
    gpucomm.destroy_process_group()
    return results


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_captured_program_outlives_the_cache(kernels):
    expected = [float(sum(r + step for r in range(2))) for step in range(3)]
    assert run_ranks(_graph_outlives_the_cache, 2, kernels, timeout=600) == [expected, expected]


# 30 s and a 40 s sleep took each case past the 30 s per-test limit on an H100; 20 s
# still leaves the warm-up's wait time for a compile of one rank beyond its peer's.
_GRAPH_TIMEOUT_S = 20


def _timeout_in_a_replay(rank: int, world_size: int, kernels: str) -> list[str]:
    import time

    import torch

    import gpucomm
    from gpucomm.errors import CommBrokenError, CommTimeoutError

    # The warm-up's wait holds what one rank's compile takes beyond the other's (each compiles
    # before it launches; with Triton the second loads what the first compiled).
    device = init_cuda_group(rank, kernels, timeout=_GRAPH_TIMEOUT_S)
    t = torch.ones(256, device=device)
    gpucomm.all_reduce(t)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpucomm.all_reduce(t)
    gpucomm.barrier()
    seen = []
    if rank == 0:
        # Rank 1 never replays: rank 0's kernel waits for it until the communicator's timeout.
        graph.replay()
        torch.cuda.synchronize()
        for call in (gpucomm.check, lambda: gpucomm.all_reduce(t)):
            try:
                call()
            except (CommTimeoutError, CommBrokenError) as err:
                seen.append(type(err).__name__)
    else:
        time.sleep(_GRAPH_TIMEOUT_S + 10)  # past rank 0's timeout and its two checks
    return seen


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_timeout_inside_a_replayed_graph_is_raised(kernels):
    """Rank 0 replays alone: its kernel's wait ends at the communicator's 20 s deadline, with
    nobody watching the replay; the error must come out of check() and the next call."""
    seen = run_ranks(_timeout_in_a_replay, 2, kernels, timeout=400, allow_exit=[1])
    assert seen[0] == ["CommTimeoutError", "CommBrokenError"]
