"""The small-message all_reduce (``oneshot_small``: kernels/triton/small.py, kernels/cuda/small.cu)
on a GPU: 2 ranks on the cuda_ipc transport (they may share one GPU), Triton and CUDA C++ kernels.

- Every op of fp32, fp16, bf16 and int32 at 1, 7, 4099 and 16384 elements, with fresh random
  inputs: bitwise the program kernel's one-shot (a subgroup with ``algo="oneshot"``) and within
  the float64 reference's bound, the same bits on both ranks.
- Repeated calls on one buffer (the host's fast path) with fresh inputs, then the same call
  captured in a CUDA graph and replayed with fresh inputs, each result checked exactly
  (integer-valued floats), so that a repeat returning a rank's own input shows.

Skipped without CUDA and CuPy.
"""

from __future__ import annotations

import random

import pytest
from cuda_group import NEEDS_CUDA_IPC, init_cuda_group
from spawn import run_ranks

pytestmark = NEEDS_CUDA_IPC

KERNELS = ("triton", "cuda")
WORLD = 2


def _small(rank: int, world_size: int, kernels: str, seed: int) -> tuple[list[str], list[str]]:
    import torch
    from collective_matrix import OPS, close_enough, digest, make_input, reference

    import gpucomm

    device = init_cuda_group(rank, kernels)
    world = gpucomm.get_default_communicator()
    engine = world._engines["cuda"]
    problems: list[str] = []
    if engine.serves("all_reduce", torch.ones(7, device=device)) != "oneshot_small":
        problems.append(
            f"auto serves a 28-byte all_reduce with {engine.serves('all_reduce', torch.ones(7, device=device))}"
        )
    program = world.new_subgroup(list(range(world_size)), algo="oneshot")
    digests, case = [], 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
        for op in OPS:
            for n in (1, 7, 4099, 16384):
                case += 1
                ins = [make_input(seed, case, r, n, dtype, op) for r in range(world_size)]
                t, u = ins[rank].to(device), ins[rank].to(device)
                gpucomm.all_reduce(t, op=op)
                program.all_reduce(u, op=op)
                got = t.cpu()
                if not close_enough(got, reference(ins, op, dtype), ins, op):
                    problems.append(f"{dtype} {op.name} n={n}: wrong result")
                if not torch.equal(got.view(torch.uint8), u.cpu().view(torch.uint8)):
                    problems.append(f"{dtype} {op.name} n={n}: not the program kernel's one-shot bit for bit")
                digests.append(digest(got))
    n = 1000
    buf = torch.empty(n, device=device)

    def fill(k: int) -> float:
        buf.fill_(float(rank + 10 * k))
        return float(sum(r + 10 * k for r in range(world_size)))

    for k in range(20):
        want = fill(k)
        gpucomm.all_reduce(buf)
        if not torch.equal(buf, torch.full_like(buf, want)):
            problems.append(f"repeat {k}: {buf[:2].tolist()}, expected {want}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpucomm.all_reduce(buf)
    for k in range(20, 40):
        want = fill(k)
        graph.replay()
        torch.cuda.synchronize(device)
        if not torch.equal(buf, torch.full_like(buf, want)):
            problems.append(f"replay {k}: {buf[:2].tolist()}, expected {want}")
    del graph
    want = fill(40)
    gpucomm.all_reduce(buf)  # eager again, from the epochs the replays left on the device
    if not torch.equal(buf, torch.full_like(buf, want)):
        problems.append(f"eager after the replays: {buf[:2].tolist()}, expected {want}")
    program.close()
    gpucomm.destroy_process_group()
    return problems, digests


@pytest.mark.parametrize("kernels", KERNELS)
def test_small_all_reduce_on_the_gpu(kernels: str) -> None:
    seed = random.randrange(1 << 30)
    results = run_ranks(_small, WORLD, kernels, seed, timeout=900)
    problems = [f"rank {r}: {p}" for r, (probs, _) in enumerate(results) for p in probs]
    assert not problems, f"seed {seed}:\n" + "\n".join(problems[:40])
    assert results[0][1] == results[1][1], f"seed {seed}: the ranks' results differ bitwise"
