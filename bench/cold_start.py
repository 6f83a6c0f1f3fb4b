"""Cold start: what a fresh machine pays before its first all_reduce returns.

Its kernels are compiled for sm_90 on this host, with an empty kernel cache.

Two measurements:

- ``compile``: seconds to compile, alone and from an empty cache, each program kernel
  specialisation a DDP job hits in fp32 and bf16 (its gradient all_reduce: SUM, with AVG folding
  as SUM; its broadcast of the parameters at construction: a copy-only program);
- ``first_call``: seconds from ``init_process_group`` to the return of the first all_reduce (fp32,
  8 bytes) at 2, 4 and 8 ranks of this host sharing one fresh Triton cache folder (as the ranks of
  a node do), the slowest rank's, with the ranks compiling one at a time (``lock``: the first
  compiles, the others find it in the cache, :func:`gpucomm.ops.triton_launch.compile_lock`) and
  all at once (``no-lock``: each rank compiles the same kernel, as Triton's JIT dispatch did).

The ranks run the device path on CPU tensors with the program kernel compiled for sm_90 and bound
on the tests' CUDA driver double (bench/driver_double.py): the compile is the real one, the
launch reaches the double and stops there.

Example::

    python -m gpucomm._bench.cold_start --nproc 2 4 8 --json cold_start.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time

from .hostinfo import run_settings, write_json
from .ranks import rank_env, spawn_ranks

__all__ = ["main"]

# (name, dtype, copy_bytes): what a DDP job's collectives compile (AVG is SUM's kernel).
DDP_SPECIALISATIONS = (
    ("fp32 all_reduce", "float32", 8),
    ("bf16 all_reduce", "bfloat16", 8),
    ("broadcast (copy only)", None, 8),
)


def _first_call(
    rank: int, world: int, port: int, double: str, cache: str, lock: bool, results: multiprocessing.Queue
) -> None:
    rank_env(
        rank,
        world,
        port,
        TRITON_CACHE_DIR=os.path.join(cache, "triton"),
        GPUCOMM_CACHE_DIR=cache,
        TRITON_DEFAULT_FP_FUSION="1",
    )
    os.environ.pop("TRITON_INTERPRET", None)
    import torch

    import gpucomm
    from gpucomm.ops import triton_launch

    from .driver_double import install_host_only_kernels, wait_for_peers

    triton_launch.COMPILE_LOCK = lock
    install_host_only_kernels(double)
    t = torch.ones(2)
    start = time.perf_counter()
    gpucomm.init_process_group(transport="shm", kernels="triton", timeout=600)
    gpucomm.all_reduce(t)
    seconds = time.perf_counter() - start
    wait_for_peers(cache, "first_call", rank, world)
    gpucomm.destroy_process_group()
    results.put((rank, seconds))


def _compile_alone(double: str, results: multiprocessing.Queue) -> None:
    """Each DDP specialisation compiled from an empty cache, one after the other (one process)."""
    cache = tempfile.mkdtemp(prefix="gpucomm-cold-")
    os.environ.update(
        TRITON_CACHE_DIR=os.path.join(cache, "triton"), GPUCOMM_CACHE_DIR=cache, TRITON_DEFAULT_FP_FUSION="1"
    )
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    from triton.backends.compiler import GPUTarget

    from gpucomm.ops.launch_args import ProgramArgs
    from gpucomm.ops.triton_ops import HostOnlyTritonKernels

    from .driver_double import TARGET_ARCH

    kernels = HostOnlyTritonKernels(GPUTarget("cuda", TARGET_ARCH, 32), double)
    prog, operands, peers = (
        torch.zeros(3 * 8, dtype=torch.int64),
        torch.zeros(12, dtype=torch.int64),
        torch.zeros(4, dtype=torch.int64),
    )
    state, record = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
    seconds = {}
    for name, dtype, copy_bytes in DDP_SPECIALISATIONS:
        start = time.perf_counter()
        kernels.prepare_program(
            ProgramArgs(
                prog,
                operands,
                peers,
                state.data_ptr(),
                record.data_ptr(),
                channels=1,
                rank=0,
                world=2,
                fingerprint=7,
                half_bytes=1 << 24,
                granule=4096,
                timeout_ns=300 * 10**9,
                dtype=getattr(torch, dtype) if dtype else None,
                op=0,
                copy_bytes=copy_bytes,
                aligned=True,
                all_channels=8,
            )
        )
        seconds[name] = time.perf_counter() - start
    results.put((0, seconds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpucomm._bench.cold_start", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4, 8], help="rank counts (default: %(default)s)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of each mode per rank count, alternating (default: %(default)s)"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    args = parser.parse_args(argv)
    from .driver_double import library

    double = library()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_compile_alone, args=(double, queue))
    proc.start()
    compiles = queue.get(timeout=900)[1]
    proc.join()
    print("compile for sm_90 from an empty cache, one process, seconds:")
    for name, seconds in compiles.items():
        print(f"  {name:<24} {seconds:6.2f}")
    rows = []
    print(
        f"{'ranks':>5} {'no-lock s':>10} {'lock s':>8}   "
        "(init_process_group to the first all_reduce's return, slowest rank, "
        f"median of {args.rounds} rounds alternating; empty caches)"
    )
    for nproc in args.nproc:
        row: dict = {"nproc": nproc, "no_lock": {"rounds_max_s": []}, "lock": {"rounds_max_s": []}}
        for r in range(args.rounds):
            for lock in (False, True) if r % 2 == 0 else (True, False):
                with tempfile.TemporaryDirectory(prefix="gpucomm-cold-") as cache:
                    per_rank = spawn_ranks(_first_call, nproc, double, cache, lock, timeout=900)
                row["lock" if lock else "no_lock"]["rounds_max_s"].append(max(per_rank.values()))
        for mode in ("no_lock", "lock"):
            row[mode]["median_s"] = statistics.median(row[mode]["rounds_max_s"])
        rows.append(row)
        print(
            f"{nproc:>5} {row['no_lock']['median_s']:>10.2f} {row['lock']['median_s']:>8.2f}   "
            f"rounds: {[round(x, 1) for x in row['no_lock']['rounds_max_s']]} / "
            f"{[round(x, 1) for x in row['lock']['rounds_max_s']]}"
        )
    if args.json:
        write_json(args.json, run_settings(args), compile_s=compiles, first_call=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
