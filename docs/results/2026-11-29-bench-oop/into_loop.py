"""In place against out of place (all_reduce_into), 2 ranks on the shm workspace, alternating: per
size, the median and min of 15 samples of 5 calls (us). SLEEP_US=20 shortens the host wait's sleep.

python docs/results/2026-11-29-bench-oop/into_loop.py
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../../tests/support"))
from spawn import run_ranks  # noqa: E402


def rank_fn(rank: int, world: int, n: int, reps: int) -> dict:
    import torch

    import gpucomm
    import gpucomm.ops.reference as ref

    if os.environ.get("SLEEP_US"):
        ref._MAX_SLEEP_S = float(os.environ["SLEEP_US"]) * 1e-6
    os.sched_setaffinity(0, {rank})
    torch.set_num_threads(1)
    gpucomm.init_process_group(transport="shm", kernels="torch")
    src, out, buf = torch.ones(n), torch.empty(n), torch.ones(n)
    res = {"in": [], "oop": []}
    for _ in range(reps):
        for kind in ("oop", "in"):
            gpucomm.barrier()
            t = time.perf_counter()
            for _ in range(5):
                if kind == "in":
                    gpucomm.all_reduce(buf)
                else:
                    gpucomm.all_reduce_into(out, src)
            res[kind].append((time.perf_counter() - t) / 5 * 1e6)
            buf.fill_(1)
    gpucomm.destroy_process_group()
    return {k: (statistics.median(v), min(v)) for k, v in res.items()}


if __name__ == "__main__":
    for mb in (1, 4, 8, 16):
        r = run_ranks(rank_fn, 2, (mb << 20) // 4, 15, timeout=300)[0]
        med, low = r["oop"][0] / r["in"][0], r["oop"][1] / r["in"][1]
        print(mb, "MiB", r, f"ratio med {med:.2f} min {low:.2f}", flush=True)
