"""Does DDP's gradient communication overlap the backward pass? Step times of one model, side by side.

Every rank trains the same MLP (wide enough that its backward pass takes milliseconds, with
several gradient buckets) on CPU tensors, under DDP on a gloo process group, in these modes:

- ``compute``: ``no_sync()``: the backward pass alone, no communication;
- ``gloo``: DDP's own all-reduce on gloo (torch overlaps it with the backward pass);
- ``hook``: gpucomm's ``allreduce_hook`` on gpucomm's gloo path (asynchronous: the hook returns
  the Future of an all-reduce still in flight);
- ``hook-blocking``: the same hook waiting for its all-reduce before returning: no overlap, the
  baseline that ``hook`` is measured against;
- ``hook-shm``: gpucomm's hook on the default path of one host, the shared-memory workspace,
  where the all-reduce runs on the communicator's progress thread;
- ``hook-shm-blocking``: the same hook waiting for its all-reduce before returning.

Modes take turns in rounds (a different order each round), and each figure is the median over
rounds of a round's step time (per step the slowest rank, then the median over steps:
:func:`timing.slowest_rank`), with the spread (min-max over rounds). Overlap shows as
``hook`` close to ``gloo`` and below ``hook-blocking`` (and ``hook-shm`` below
``hook-shm-blocking``).

The ranks keep the thread settings they are started with, as a user's would: torch's default
(one thread per core) unless OMP_NUM_THREADS is set.

Example::

    OMP_NUM_THREADS=1 python -m gpucomm._bench.ddp_overlap --nproc 2 --rounds 5 --json ddp.json
    python -m gpucomm._bench.ddp_overlap --nproc 2 --rounds 5 --json ddp_default_threads.json
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

__all__ = ["main", "MODES"]

MODES = ("compute", "gloo", "hook", "hook-blocking", "hook-shm", "hook-shm-blocking")


def _step_times(rank: int, world: int, port: int, args: argparse.Namespace, results: multiprocessing.Queue) -> None:
    rank_env(rank, world, port)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gpucomm import ddp
    from gpucomm.comm.communicator import Communicator
    from gpucomm.config import Config

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    store = dist.distributed_c10d._get_default_store()
    comms = {
        "hook": Communicator(store, rank, world, prefix="overlap/gloo/", config=Config.from_env(transport="gloo")),
        "hook-shm": Communicator(store, rank, world, prefix="overlap/shm/", config=Config.from_env(transport="shm")),
    }

    def blocking_hook(state, bucket):  # noqa: ANN001, ANN202 (DDP checks annotations as objects)
        fut = ddp.allreduce_hook(state, bucket)
        fut.wait()
        return fut

    def wrapped(mode: str) -> DistributedDataParallel:
        """A DDP wrapper of the same layers with the mode's hook (a hook is registered once per wrapper)."""
        model = DistributedDataParallel(layers, bucket_cap_mb=args.bucket_mb)
        if mode.startswith("hook"):
            comm = comms["hook-shm" if mode.startswith("hook-shm") else "hook"]
            model.register_comm_hook(
                ddp.GpucommState(comm=comm), blocking_hook if mode.endswith("-blocking") else ddp.allreduce_hook
            )
        return model

    batch = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))

    def steps(model: DistributedDataParallel, mode: str) -> list[float]:
        times = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            if mode == "compute":
                with model.no_sync():
                    model(batch).square().mean().backward()
            else:
                model(batch).square().mean().backward()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        return times

    modes = tuple(args.modes)
    rounds: dict[str, list[list[float]]] = {m: [] for m in modes}  # each round's step times
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else tuple(reversed(modes)):
            model = wrapped(mode)
            steps(model, mode)  # warm-up
            rounds[mode].append(steps(model, mode))
    for comm in comms.values():
        comm.close()
    dist.destroy_process_group()
    results.put((rank, rounds))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gpucomm._bench.ddp_overlap",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every mode, alternating")
    p.add_argument("--steps", type=int, default=10, help="timed steps per mode and round (median taken)")
    p.add_argument("--width", type=int, default=1024, help="width of the MLP's layers")
    p.add_argument("--layers", type=int, default=8, help="layers of the MLP")
    p.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="DDP's bucket_cap_mb")
    p.add_argument(
        "--modes",
        nargs="+",
        default=list(MODES),
        choices=MODES,
        help="modes to time (gloo is always one: the baseline)",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write settings and every round's medians")
    args = p.parse_args(argv)
    if "gloo" not in args.modes:
        args.modes = ["gloo", *args.modes]
    per_rank = spawn_ranks(_step_times, args.nproc, args)
    # A step ends when the slowest rank's does (the steps start together, after a barrier): the
    # figure of a round is per step the slowest rank, then the median over steps.
    rounds = {
        m: [slowest_rank([per_rank[r][m][k] for r in sorted(per_rank)]) for k in range(args.rounds)] for m in args.modes
    }
    threads = os.environ.get("OMP_NUM_THREADS", f"not set: torch's default, {os.cpu_count()} cores")
    print(
        f"# DDP step (forward + backward) on CPU, {args.nproc} ranks, MLP {args.layers} x {args.width}, "
        f"batch {args.batch}, buckets of {args.bucket_mb:g} MB, OMP_NUM_THREADS {threads}; "
        f"median [min-max] over {args.rounds} rounds, ms"
    )
    base = statistics.median(rounds["gloo"])
    for mode in args.modes:
        values = rounds[mode]
        med = statistics.median(values)
        print(
            f"{mode:>14}  {med * 1e3:8.2f}  [{min(values) * 1e3:.2f}-{max(values) * 1e3:.2f}]  "
            f"x{med / base:.2f} of gloo"
        )
    if args.json:
        write_json(args.json, run_settings(args), rounds_s=rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
