"""Host time of a repeated small collective: what gpucomm's own Python costs per call.

Two ranks. On the device path (the Triton program kernel on the shared-memory workspace) what is
timed is everything the host does for a call, which on a GPU is all a blocking small collective
costs the host. ``--launch`` says how the kernel is launched:

- ``bound`` (default): the program kernel compiled for sm_90 and its launch bound through
  gpucomm's launcher (:mod:`gpucomm.ops.triton_launch`) on the tests' CUDA driver double
  (bench/driver_double.py), which records the launch and runs nothing: timed up to and including
  the call into the driver. The double's launches are counted per call;
- ``jit``: through Triton's JIT dispatch. It needs a CUDA device (the dispatch asks torch for the
  current device and stream), so on a host without one the entry says so and quotes the published
  figures instead of a measurement;
- ``recorder``: the Triton interpreter's launch replaced by a recorder: gpucomm's Python up to
  the launch, the recorder's own cost timed too.

On the shared-memory path (the torch kernels) the collective runs for real: 8 bytes between two
ranks, waits included. Each call is timed alone; the median and p90 in microseconds, and the
Python function calls per call (``sys.setprofile``: every call event inside one collective).

``--record-rounds N`` also times what the flight record (:mod:`gpucomm.reliability.flight`) costs
on each path: N rounds of ``--calls`` calls alternating the communicator's own flight log and one whose
hooks do nothing (both ranks swap together), the median call of each round, and the median over
rounds of each pair's ratio.

Example::

    python -m gpucomm._bench.host_time --calls 2000 --json host_time.json
    python -m gpucomm._bench.host_time --paths device --launch bound jit
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile

from .flight_cost import SilentFlightLog
from .hostinfo import run_settings, write_json
from .ranks import rank_env, spawn_ranks
from .samples import each_call, median_p90_us

__all__ = ["main", "JIT_PUBLISHED_US"]

# Published host time of one launch through Triton's JIT dispatch, where it cannot run here:
# triton-lang/triton PR #7771 (27 us before it, 13-17 us after, ~19
# arguments, H100 host); tritonbench PR #669 (13.2 us with 19 arguments, 3.6 us calling the compiled
# kernel directly); vLLM PR #34838 (8.7 us through the JIT, 4.5 us through a cached compiled kernel).
JIT_PUBLISHED_US = {
    "triton PR 7771 (after)": [13.0, 17.0],
    "tritonbench PR 669": 13.2,
    "vLLM PR 34838": 8.7,
    "bare cuLaunchKernel": [1.3, 1.6],
}


def _python_calls(call) -> int:  # noqa: ANN001
    """Function calls (Python and C) during one ``call()``."""
    count = 0

    def profile(frame, event, arg):  # noqa: ANN001, ANN202 (sys.setprofile's signature)
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count


def _rank(
    rank: int,
    world: int,
    port: int,
    path: str,
    launch: str,
    double: str | None,
    sync: str,
    calls: int,
    record_rounds: int,
    results: multiprocessing.Queue,
) -> None:
    rank_env(rank, world, port)
    if path == "device" and launch == "recorder":
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # bound: the real compiler, for sm_90
    import torch

    import gpucomm

    recorded = 0
    if path == "device" and launch == "bound":
        from .driver_double import install_host_only_kernels

        install_host_only_kernels(double)
        gpucomm.init_process_group(transport="shm", kernels="triton", timeout=120)
    elif path == "device":
        from triton.runtime.interpreter import InterpretedFunction

        def recorder(fn, *args, **kwargs):  # noqa: ANN001, ANN202 (Triton's signature)
            nonlocal recorded
            recorded += 1

        InterpretedFunction.run = recorder
        gpucomm.init_process_group(transport="shm", kernels="triton", timeout=120)
    else:
        gpucomm.init_process_group(transport="shm", kernels="torch", timeout=120)
    t = torch.ones(2)  # 8 bytes
    for _ in range(50):
        gpucomm.all_reduce(t)
    gpucomm.barrier()
    out = {
        "path": path,
        "launch": launch if path == "device" else "shm",
        **median_p90_us(each_call(lambda: gpucomm.all_reduce(t), calls)),
        "python_calls": _python_calls(lambda: gpucomm.all_reduce(t)),
    }
    if path == "device" and launch == "bound":
        from .driver_double import launches

        launches_before = launches(double)
        gpucomm.all_reduce(t)
        out["launches_per_call"] = launches(double) - launches_before
    elif path == "device":
        launches_before = recorded
        gpucomm.all_reduce(t)
        out["launches_per_call"] = recorded - launches_before
        out["recorder_us"] = median_p90_us(each_call(lambda: InterpretedFunction.run(None), calls))["median_us"]
    if record_rounds:
        out["record"] = _record_cost(
            gpucomm.distributed.lookup.world("host_time"), lambda: gpucomm.all_reduce(t), calls, record_rounds
        )
    if double is not None:  # no kernel runs on the double: gpucomm.barrier() waits for nobody
        from .driver_double import wait_for_peers

        wait_for_peers(sync, "done", rank, world)
    gpucomm.barrier()
    gpucomm.destroy_process_group()
    results.put((rank, out))


def _record_cost(comm, call, calls: int, rounds: int) -> dict:  # noqa: ANN001
    """Median call with the real flight log and with a silent one, rounds alternating."""
    real, silent = comm._flight, SilentFlightLog()
    medians: dict[str, list[float]] = {"with": [], "without": []}
    for i in range(rounds):
        for name in ("with", "without") if i % 2 == 0 else ("without", "with"):
            comm._flight = real if name == "with" else silent
            medians[name].append(median_p90_us(each_call(call, calls))["median_us"])
    comm._flight = real
    ratios = [w / wo for w, wo in zip(medians["with"], medians["without"])]
    return {
        "with_us": statistics.median(medians["with"]),
        "without_us": statistics.median(medians["without"]),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "rounds_with_us": medians["with"],
        "rounds_without_us": medians["without"],
    }


def measure(path: str, calls: int, record_rounds: int = 0, launch: str = "bound") -> dict:
    """Rank 0's figures for ``path`` ("device" or "shm").

    The device path's kernel is launched as ``launch`` ("bound", "jit" or "recorder").
    """
    if path == "device" and launch == "jit":
        return _jit_here()
    double = None
    if path == "device" and launch == "bound":
        from .driver_double import library

        double = library()
    with tempfile.TemporaryDirectory(prefix="gpucomm-host-time-") as sync:
        per_rank = spawn_ranks(_rank, 2, path, launch, double, sync, calls, record_rounds, timeout=600)
    return per_rank[0]


def _jit_here() -> dict:
    """The JIT dispatch's entry: not measured where no CUDA device can run it.

    The driver double cannot stand in: the dispatch asks torch, built without CUDA here, for the
    device and stream.
    """
    import torch

    if not torch.cuda.is_available():
        return {
            "path": "device",
            "launch": "jit",
            "median_us": None,
            "p90_us": None,
            "python_calls": None,
            "not_measured": "Triton's JIT dispatch needs a CUDA device (torch.cuda is unavailable here); "
            "published figures per launch instead",
            "published_us": JIT_PUBLISHED_US,
        }
    raise SystemExit(
        "--launch jit with a CUDA device: bench/gpu_latency.py measures it on the GPU "
        "(bench/gpu_check.sh's latency part)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpucomm._bench.host_time", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per path (default: %(default)s)")
    parser.add_argument(
        "--paths", nargs="+", default=["device", "shm"], choices=["device", "shm"], help="paths to time"
    )
    parser.add_argument(
        "--launch",
        nargs="+",
        default=["bound"],
        choices=["bound", "jit", "recorder"],
        help="how the device path launches its kernel (default: %(default)s; see the module docstring)",
    )
    parser.add_argument(
        "--record-rounds", type=int, default=0, help="rounds timing the flight record's cost (default: none)"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    args = parser.parse_args(argv)
    runs = [(path, launch) for path in args.paths for launch in (args.launch if path == "device" else ["shm"])]
    rows = [measure(path, args.calls, args.record_rounds, launch) for path, launch in runs]
    print(
        f"{'path':<8} {'launch':<9} {'median us':>10} {'p90 us':>8} {'py calls':>9}   "
        f"(2 ranks, 8-byte all_reduce, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})"
    )
    for row in rows:
        if row["median_us"] is None:
            print(
                f"{row['path']:<8} {row['launch']:<9} {'-':>10} {'-':>8} {'-':>9}   "
                f"{row['not_measured']}: {row['published_us']}"
            )
            continue
        extra = f"   recorder {row['recorder_us']:.2f} us," if "recorder_us" in row else ""
        extra += f"   {row['launches_per_call']} launch per call" if "launches_per_call" in row else ""
        print(
            f"{row['path']:<8} {row['launch']:<9} {row['median_us']:>10.1f} {row['p90_us']:>8.1f} "
            f"{row['python_calls']:>9}{extra}"
        )
    for row in rows:
        if "record" in row:
            r = row["record"]
            print(
                f"{row['path']:<8} flight record: {r['with_us']:.2f} us with, {r['without_us']:.2f} us without; "
                f"ratio {r['ratio_median']:.3f} (rounds {r['ratio_min']:.3f}-{r['ratio_max']:.3f})"
            )
    if args.json:
        write_json(args.json, run_settings(args), results=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
