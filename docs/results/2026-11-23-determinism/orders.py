"""How many elements ring and tree change against one-shot: 4 ranks, CPU shared-memory
workspace, torch kernels, 1 Mi elements of tests/comm/test_determinism.py's wide-range inputs.

Run from the repository root:
    python docs/results/2026-11-23-determinism/orders.py > docs/results/2026-11-23-determinism/orders.json
"""

import json
import os
import sys

sys.path[:0] = [os.path.join(os.getcwd(), "tests", "support"), os.path.join(os.getcwd(), "tests", "comm")]
from spawn import run_ranks  # noqa: E402

N, PREFIX, SEED = 1 << 20, 4096, 11


def job(rank: int, world_size: int) -> dict:
    import warnings

    from test_determinism import _bits, wide

    import gpucomm

    warnings.simplefilter("ignore")  # ring and tree warn that they leave the contract: we know
    out = {}
    for dtype in ("float32", "bfloat16"):
        x = wide(SEED, 1, rank, N, dtype)
        res = {}
        for algo in ("oneshot", "twoshot", "ring", "tree"):
            gpucomm.init_process_group(transport="shm", kernels="torch", algo=algo, timeout=300)
            whole, head = x.clone(), x[:PREFIX].clone()
            gpucomm.all_reduce(whole)
            gpucomm.all_reduce(head)
            res[algo], res[algo + " prefix"] = whole, head
            gpucomm.destroy_process_group()
        for algo in ("twoshot", "ring", "tree"):
            out[f"{dtype} {algo}: elements unlike one-shot's, of {N}"] = int(
                (_bits(res[algo]) != _bits(res["oneshot"])).sum()
            )
            unlike = _bits(res[algo + " prefix"]) != _bits(res[algo][:PREFIX])
            out[f"{dtype} {algo}: first {PREFIX} reduced alone, elements unlike the same elements of {N}"] = int(
                unlike.sum()
            )
    return out


if __name__ == "__main__":
    print(json.dumps(run_ranks(job, 4, timeout=900)[0], indent=1))
