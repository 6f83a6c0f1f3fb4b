"""Two-shot's fold stores its result twice (REDUCE with STORE_ALSO: into this rank's half for the
peers, and into its own tensor, where the own-slice copy-out used to be) and, pipelined, carries the
next piece's copy-in (COPYs flagged CARRIED, run inside the fold's loop), in both kernel families:
Triton's program kernel under the interpreter and the CUDA C++ one built for the host
(GPUCOMM_CUDA_EMULATE=1), across real processes on the shared-memory workspace.

Every dtype the program kernel folds, on fresh random inputs, against float64 references; sizes of
one piece (two SYNCs) and of a few and many pieces (pipelined), with element counts that end inside a 16-byte
vector and inside a granule, on tensors 16-byte aligned and not (one element into their storage);
this rank's halves poisoned before each call. Each result is also bitwise one-shot's (the fold
order is the same), and every rank ends with the same bytes. Without the second store, a rank's own
slice would keep its input and fail the reference; without a carried copy, the peers would fold
poison.
"""

from __future__ import annotations

import random

import pytest
from spawn import run_ranks

INTERPRET = {"TRITON_INTERPRET": "1"}
EMULATE = {"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64"}
FAMILIES = {"triton": INTERPRET, "cuda": EMULATE}
# 16 KiB: 6 KiB halves (8 KiB of fp32 is 2 pieces, 80 KiB 14); 64 KiB: 24 KiB halves, where a
# channel's share of a fold spans several iterations of the CUDA C++ vector body (2 KiB each at 64
# threads), so a carried copy is cut into several shares.
WORKSPACES = ("16K", "64K")


def _cases():
    import torch

    from gpucomm import ReduceOp

    # (elements, dtype, op, elements of skew before the tensor in its storage)
    return [
        (7, torch.float32, ReduceOp.SUM, 0),
        (1029, torch.float32, ReduceOp.AVG, 1),
        (2053, torch.float16, ReduceOp.MAX, 1),
        (3001, torch.bfloat16, ReduceOp.SUM, 0),
        (1027, torch.float64, ReduceOp.PRODUCT, 1),
        (2051, torch.int32, ReduceOp.MIN, 1),
        (1025, torch.int64, ReduceOp.SUM, 0),
        (20011, torch.float32, ReduceOp.SUM, 1),
        (20011, torch.bfloat16, ReduceOp.AVG, 0),
        # A first piece of 1/4 half, then even pieces whose slices start on 16-byte boundaries (at
        # 24 KiB halves: 6 KiB, then 4 x 5856 elements, slices of 1952): the vector body throughout.
        (24960, torch.float32, ReduceOp.SUM, 0),
    ]


def _ranks(rank: int, world_size: int, seed: int, kernels: str, workspace: str) -> tuple[list[str], list[str]]:
    import torch
    from collective_matrix import close_enough, digest, make_input, reference

    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels=kernels, workspace_bytes=workspace, timeout=120, channels=2)
    comm = gpucomm.get_default_communicator()
    engine = comm._engines["cpu"]
    groups = {algo: comm.new_subgroup(list(range(world_size)), algo=algo) for algo in ("oneshot", "twoshot")}
    problems, digests = [], []
    for case, (n, dtype, op, skew) in enumerate(_cases()):
        ins = [make_input(seed, case, r, n, dtype, op) for r in range(world_size)]
        want = reference(ins, op, dtype)
        out = {}
        for algo, group in groups.items():
            storage = torch.empty(n + skew, dtype=dtype)
            t = storage[skew:]
            t.copy_(ins[rank])
            group.barrier()
            ws = engine.workspace  # garbage in both of my halves: a stale read would show it
            ws.data(engine.rank, engine.p2p_bytes, 2 * engine.half_bytes).bytes.fill_(0xA5)
            group.barrier()
            group.all_reduce(t, op)
            out[algo] = t
        what = f"n={n} {dtype} {op.name} skew={skew}"
        if not close_enough(out["twoshot"], want, ins, op):
            bad = (out["twoshot"].to(torch.float64) != want.to(out["twoshot"].dtype).to(torch.float64)).nonzero()
            problems.append(f"{what}: two-shot wrong, first at {bad.flatten()[:4].tolist()}")
        if not torch.equal(out["twoshot"].view(torch.uint8), out["oneshot"].view(torch.uint8)):
            problems.append(f"{what}: two-shot and one-shot differ in bits")
        digests.append(digest(out["twoshot"]))
    for group in groups.values():
        group.close()
    gpucomm.destroy_process_group()
    return problems, digests


def _check(results: list, seed: int) -> None:
    problems = [f"rank {r}: {p}" for r, (probs, _) in enumerate(results) for p in probs]
    assert not problems, f"seed {seed}:\n" + "\n".join(problems[:40])
    for r, (_, d) in enumerate(results):
        assert d == results[0][1], f"seed {seed}: rank {r}'s results differ bitwise from rank 0's"


# 3 ranks: rank 1's copy-in is two ranges (the slices before its own and after), both carried.
@pytest.mark.parametrize("workspace", WORKSPACES)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kernels", list(FAMILIES))
def test_two_shot_folds_into_half_and_tensor_in_both_kernel_families(
    kernels: str, world_size: int, workspace: str
) -> None:
    seed = random.randrange(1 << 30)
    _check(run_ranks(_ranks, world_size, seed, kernels, workspace, env=FAMILIES[kernels], timeout=900), seed)
