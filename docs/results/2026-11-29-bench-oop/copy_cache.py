"""What ``out.copy_(src)`` costs one bound core, with its buffers in the core's cache and without.

One process bound to core 0, one torch thread. Per size, 60 copies each: ``warm`` back to back
(source and output stay in the 2 MiB L2 up to 1 MiB), ``evicted`` with a 16 MiB tensor written
before each copy, as the collective's own traffic between two copies of the bench's out-of-place
all_reduce writes its workspace. ``separate`` buffers are their own allocations; ``pool`` ones
are views of the front of two 16 MiB buffers (bench/buffers.py). Run:

    python docs/results/2026-11-29-bench-oop/copy_cache.py
"""

import os
import statistics
import time

import torch


def main() -> None:
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    pool_src, pool_out = torch.ones(4 << 20), torch.zeros(4 << 20)
    evictor = torch.ones(4 << 20)
    with open("/proc/loadavg") as fh:
        print(f"# load average {' '.join(fh.read().split()[:3])}; median of 60 copies, us")
    for kib in (256, 1024, 2048, 4096):
        n = kib * 256
        kinds = {"separate": (torch.ones(n), torch.zeros(n)), "pool": (pool_src[:n], pool_out[:n])}
        for kind, (src, out) in kinds.items():
            for evicted in (False, True):
                times = []
                for _ in range(60):
                    if evicted:
                        evictor.add_(1)
                    t0 = time.perf_counter()
                    out.copy_(src)
                    times.append(time.perf_counter() - t0)
                label = "evicted" if evicted else "warm"
                print(f"{kib:5d}K {kind:8s} {label:7s} {statistics.median(times) * 1e6:7.1f}")


if __name__ == "__main__":
    main()
