"""Kernel launches and host reads per collective call, under the Triton interpreter.

Every rank runs each collective twice on the shared-memory workspace with the Triton kernels
(``TRITON_INTERPRET=1``, set in the ranks before triton is imported) and counts, for the second
call (the first builds the program), the Triton launches and the reads of tensor memory by the
host (``tolist``, ``item``, ``cpu``, ``int()``): on a GPU each such read waits for the device.

Example::

    python -m gpucomm._bench.launches --nproc 3
    python -m gpucomm._bench.launches --nproc 8 --algo ring --json ring8.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys

from .hostinfo import run_settings, write_json
from .ranks import rank_env, spawn_ranks

__all__ = ["main"]

_HOST_READS = ("tolist", "item", "cpu", "__int__")


def _count(rank: int, world: int, port: int, numel: int, algo: str, results: multiprocessing.Queue) -> None:
    rank_env(rank, world, port, TRITON_INTERPRET="1")
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    import gpucomm

    counts = {"launches": 0, "host_reads": 0}
    launch = InterpretedFunction.run

    def counted_launch(fn, *args, **kwargs):  # noqa: ANN001, ANN202 (Triton's signature)
        counts["launches"] += 1
        return launch(fn, *args, **kwargs)

    InterpretedFunction.run = counted_launch
    for name in _HOST_READS:
        read = getattr(torch.Tensor, name)

        def counted_read(self, *args, _read=read, **kwargs):  # noqa: ANN001, ANN202
            counts["host_reads"] += 1
            return _read(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted_read)

    gpucomm.init_process_group(transport="shm", kernels="triton", algo=algo, timeout=120)
    x = torch.ones(numel)
    outs = [torch.empty(numel) for _ in range(world)]
    flat, gathered = torch.ones(numel * world), torch.empty(numel * world)
    calls = {
        "all_reduce": lambda: gpucomm.all_reduce(x),
        "broadcast": lambda: gpucomm.broadcast(x, src=0),
        "reduce": lambda: gpucomm.reduce(x, dst=0),
        "all_gather_into_tensor": lambda: gpucomm.all_gather_into_tensor(gathered, x),
        "reduce_scatter_tensor": lambda: gpucomm.reduce_scatter_tensor(x, flat),
        "gather": lambda: gpucomm.gather(x, outs if rank == 0 else None, dst=0),
        "scatter": lambda: gpucomm.scatter(x, outs if rank == 0 else None, src=0),
        "all_to_all_single": lambda: gpucomm.all_to_all_single(gathered, flat),
        "barrier": lambda: gpucomm.barrier(),
    }
    seen = {}
    for name, call in calls.items():
        call()
        counts.update(launches=0, host_reads=0)
        call()
        seen[name] = dict(counts)
    gpucomm.destroy_process_group()
    results.put((rank, seen))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpucomm._bench.launches", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=3, help="ranks to spawn")
    parser.add_argument("--numel", type=int, default=7, help="fp32 elements per rank")
    parser.add_argument("--algo", default="auto", help="GPUCOMM_ALGO for the calls")
    parser.add_argument("--json", default=None, metavar="FILE", help="write rank 0's counts as JSON")
    args = parser.parse_args(argv)
    per_rank = spawn_ranks(_count, args.nproc, args.numel, args.algo, timeout=1200)
    counts = per_rank[0]
    print(
        f"{'collective':<24} {'launches':>8} {'host reads':>10}   "
        f"({args.nproc} ranks, {args.numel} fp32, algo={args.algo})"
    )
    for name, c in counts.items():
        print(f"{name:<24} {c['launches']:>8} {c['host_reads']:>10}")
    if args.json:
        write_json(args.json, run_settings(args), counts=counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
