"""How long an ``async_op=True`` all_reduce takes to return, against the blocking call, on CPU tensors.

Every rank runs gpucomm's default path (on one host: the shared-memory workspace) and, in
alternating order within each round, times a blocking ``all_reduce`` of the given size (call to
return) and an asynchronous one (call to return, then to the end of ``wait()``), each after a
barrier, each on an input refilled before it. It checks every timed call: the blocking call's
result and the asynchronous call's Future, which must hold the reduced tensor. Each figure is the
median over rounds of the slowest rank's time in the round (:func:`timing.slowest_rank`, one call
per round and mode).

Example::

    python -m gpucomm._bench.async_return --nproc 2 --size 32M --rounds 7 --json async.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

from .hostinfo import run_settings, write_json
from .ranks import rank_env, spawn_ranks
from .timing import slowest_rank

__all__ = ["main"]


def _rank(rank: int, world: int, port: int, numel: int, rounds: int, results: multiprocessing.Queue) -> None:
    rank_env(rank, world, port)
    import torch

    import gpucomm

    gpucomm.init_process_group()
    t = torch.empty(numel)
    total = float(sum(range(1, world + 1)))
    times: dict[str, list[float]] = {"blocking": [], "async_return": [], "async_end": []}
    correct = True
    for r in range(rounds + 1):  # round 0 warms up (programs built, pages touched)
        for mode in ("blocking", "async") if r % 2 else ("async", "blocking"):
            t.fill_(rank + 1)
            gpucomm.barrier()
            start = time.perf_counter()
            if mode == "blocking":
                gpucomm.all_reduce(t)
                took = {"blocking": time.perf_counter() - start}
                correct &= bool((t == total).all())
            else:
                work = gpucomm.all_reduce(t, async_op=True)
                returned = time.perf_counter() - start
                value = work.get_future().wait()[0]
                took = {"async_return": returned, "async_end": time.perf_counter() - start}
                correct &= value is t and bool((t == total).all())
            if r:
                for k, v in took.items():
                    times[k].append(v)
    path = gpucomm.get_default_communicator().paths()["cpu"]
    gpucomm.destroy_process_group()
    results.put((rank, (times, correct, path)))


def main(argv: list[str] | None = None) -> int:
    from .sizes import parse_size

    p = argparse.ArgumentParser(
        prog="python -m gpucomm._bench.async_return",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn")
    p.add_argument("--size", type=parse_size, default="32M", help="bytes per rank (float32)")
    p.add_argument("--rounds", type=int, default=7, help="rounds, each timing both calls in alternating order")
    p.add_argument("--json", default=None, metavar="FILE", help="write settings and every round's times")
    args = p.parse_args(argv)
    numel = max(1, args.size // 4)
    per_rank = spawn_ranks(_rank, args.nproc, numel, args.rounds)
    keys = ("blocking", "async_return", "async_end")
    slowest = {k: [slowest_rank([[per_rank[r][0][k][i]] for r in per_rank]) for i in range(args.rounds)] for k in keys}
    med = {k: statistics.median(v) for k, v in slowest.items()}
    threads = os.environ.get("OMP_NUM_THREADS", "not set")
    print(
        f"# all_reduce of {numel * 4} B float32, {args.nproc} ranks, {per_rank[0][2]}, OMP_NUM_THREADS {threads};"
        f" median [min-max] over {args.rounds} rounds of the slowest rank, ms"
    )
    for k in keys:
        print(
            f"{k:>13}  {med[k] * 1e3:9.3f}  [{min(slowest[k]) * 1e3:.3f}-{max(slowest[k]) * 1e3:.3f}]  "
            f"x{med[k] / med['blocking']:.3f} of blocking"
        )
    ok = all(v[1] for v in per_rank.values())
    print("every call's result, and the future holding the reduced tensor: " + ("PASS" if ok else "FAIL"))
    if args.json:
        write_json(args.json, run_settings(args, path=per_rank[0][2]), rounds_s=slowest, correct=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
