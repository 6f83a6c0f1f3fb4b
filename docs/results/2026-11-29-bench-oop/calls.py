"""Per-call CPU wall clock of gpucomm's and gloo's all_reduce, in place and as copy_ + in place.

Two spawned ranks, each bound to a core of its own as ``gpucomm-bench --bind auto`` binds them,
one torch thread each, gloo and gpucomm started side by side as the bench starts them. Per size
and backend, each variant runs 5 untimed calls, then ``iters`` timed ones; for each it prints
the slowest rank's median, 10th-90th percentiles, the share of calls over 1 ms and the minor
page faults per call (getrusage). Variants:

- in: ``all_reduce(buf)``;
- oop: ``out.copy_(src)`` then ``all_reduce(out)``, both buffers allocated once (the bench);
- copy: ``out.copy_(src)`` alone;
- oop_fresh: the output allocated afresh for each call (``torch.empty``), then as oop.

``--free-gloo`` lets gloo's threads (started with the rank's core) run on both cores, the rank's
own thread still bound. Run:

    python docs/results/2026-11-29-bench-oop/calls.py [--free-gloo] [--iters 100] [--sizes 256,1024]
"""

import argparse
import multiprocessing
import os
import resource
import socket
import statistics
import time

VARIANTS = ("in", "oop", "copy", "oop_fresh")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _variants(torch, mod, n: int) -> dict:
    """The calls of each variant for ``n`` float32 elements on backend module ``mod``."""
    buf, src, out = torch.ones(n), torch.ones(n), torch.ones(n)

    def oop() -> None:
        out.copy_(src)
        mod.all_reduce(out)

    def fresh() -> None:
        o = torch.empty(n)
        o.copy_(src)
        mod.all_reduce(o)

    return {"in": lambda: mod.all_reduce(buf), "oop": oop, "copy": lambda: out.copy_(src), "oop_fresh": fresh}


def _rank(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {sorted(cores)[rank]})
    import torch
    import torch.distributed as dist

    from gpucomm._bench.backends import make_backend

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    backends = [
        make_backend(name, dist.PrefixStore(f"b/{name}", store), rank, 2, torch.device("cpu"), {}, None)
        for name in ("gloo", "gpucomm")
    ]
    if args.free_gloo:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as fh:
                if "gloo" in fh.read():
                    os.sched_setaffinity(int(tid), cores)
    results = {}
    for kib in args.sizes:
        n = kib * 256
        for backend in backends:
            calls = _variants(torch, backend.mod, n)
            for name in VARIANTS:
                for _ in range(5):
                    calls[name]()
                backend.mod.barrier()
                times, faults = [], []
                for _ in range(args.iters):
                    f0, t0 = _faults(), time.perf_counter()
                    calls[name]()
                    times.append(time.perf_counter() - t0)
                    faults.append(_faults() - f0)
                results[(kib, backend.name, name)] = (times, faults)
                backend.mod.barrier()
    queue.put((rank, results))
    for backend in reversed(backends):
        backend.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--free-gloo", action="store_true")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--sizes", type=lambda s: [int(k) for k in s.split(",")], default=[256, 512, 1024, 2048])
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    per_rank = dict(queue.get() for _ in procs)
    for proc in procs:
        proc.join()
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    print(f"# load average {' '.join(load)}; gloo's threads {'free' if args.free_gloo else 'on the rank core'}")
    print("# size backend variant: slowest rank's median us [p10-p90], share of calls over 1 ms, faults per call")
    for key in per_rank[0]:
        times = [max(t) for t in zip(*(per_rank[r][key][0] for r in per_rank))]
        faults = max(statistics.mean(per_rank[r][key][1]) for r in per_rank)
        dec = statistics.quantiles(times, n=10)
        slow = sum(t > 1e-3 for t in times) / len(times)
        print(
            f"{key[0]:5d}K {key[1]:8s} {key[2]:9s} {statistics.median(times) * 1e6:8.1f} "
            f"[{dec[0] * 1e6:.0f}-{dec[-1] * 1e6:.0f}] slow {slow:.2f} faults {faults:.1f}"
        )


if __name__ == "__main__":
    main()
