"""Latency of a small all_reduce on CUDA tensors, eager and replayed from a CUDA graph.

Every rank (a GPU each, or several on one GPU under MPS: ``torch.cuda.set_device(rank % count)``)
repeats a blocking all_reduce of ``--bytes`` of fp32 on the workspace path (CUDA IPC, the
``--kernels`` program kernel), in rounds that alternate two modes:

- ``eager``: ``--iters`` calls back to back on the caller's current stream. Device time per call
  is the burst between two CUDA events divided by the calls; host time per call is the wall time
  the host takes to queue them (a blocking call on a GPU returns once its kernel is queued), and
  a burst's end is synchronised before the next.
- ``graph``: ``--per-graph`` calls captured once into a CUDA graph, replayed ``--replays`` times
  between two events; time per call is that time divided by every captured call.
- beside each eager burst, two floors under it: ``torch_launch_host_us``, the host time per call
  of ``--iters`` plain torch launches (``add_(0)`` on the same tensor), this host's price of any
  launch through torch; and, with ``--launch bound``, ``launcher_host_us``, the host time per call
  of ``--iters`` bare launches through gpucomm's launcher (a prepared 16-byte CUDA C++ copy on the
  caller's stream: the driver's ``cuLaunchKernel`` and one C call). The eager call's host time
  less ``launcher_host_us`` is gpucomm's own part (docs/performance.md has it measured on an
  H100 host).

``--launch`` picks how the program kernel is launched: ``bound`` (gpucomm's launcher: one
``cuLaunchKernel`` per call, :mod:`gpucomm.ops.launcher`) or ``jit`` (Triton's JIT dispatch for
``--kernels triton``, CuPy's Function for ``--kernels cuda``: what served before the launcher, and
what serves where it cannot be built). Each entry of the JSON says which.

The figure of a round is the slowest rank's, the result the median over rounds with the spread
(:func:`timing.slowest_rank`, a round being the iteration: its calls are timed as one burst).
The calls timed are not checked one by one (they sum into one tensor over and over); after the
last round, and so after every graph replay, the tensor is refilled with rank + 1 and one more
eager call is checked on every rank, exactly (:func:`timing.check_after`); a wrong one marks
every figure of the JSON and fails the run. The goals at 8 bytes and 2 ranks on one GPU with MPS:
eager at most 15 us, captured at most 8.

Needs CUDA (and CuPy for the CUDA IPC workspace); ``bench/gpu_check.sh`` runs it on a lent GPU.

Example::

    python -m gpucomm._bench.gpu_latency --nproc 2 --bytes 8 --rounds 5 --json gpu_latency.json
    python -m gpucomm._bench.gpu_latency --launch jit --json gpu_latency_jit.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time

from .hostinfo import run_settings, write_json
from .ranks import rank_env, spawn_ranks
from .timing import check_after, slowest_rank

__all__ = ["main"]


def _bare_launch(device):  # noqa: ANN001, ANN202
    """A prepared 16-byte copy through gpucomm's launcher on ``device``, with the tensors it copies.

    None where the launcher or the CUDA C++ kernels cannot be had (the reason printed).
    """
    import torch

    from gpucomm.errors import UnsupportedError
    from gpucomm.ops.contract import Region
    from gpucomm.ops.cuda_ops import CudaKernels

    try:
        kernels = CudaKernels(device)
    except UnsupportedError as err:
        print(f"gpu_latency: launcher_host_us not measured: {err}", flush=True)
        return None
    if kernels._driver is None:
        print("gpu_latency: launcher_host_us not measured: gpucomm's launcher cannot be built here", flush=True)
        return None
    src, dst = torch.zeros(4, device=device), torch.empty(4, device=device)
    return kernels.prepare_copy(Region.of(dst), Region.of(src)), (src, dst)  # the memory lives with the launch


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, results: multiprocessing.Queue) -> None:
    rank_env(rank, world, port)
    import torch

    import gpucomm

    torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    if args.launch == "jit":
        from gpucomm.ops import registry
        from gpucomm.ops.cuda_ops import CudaKernels
        from gpucomm.ops.triton_ops import JitDispatchTritonKernels

        kernels = JitDispatchTritonKernels(device) if args.kernels == "triton" else CudaKernels(device, launcher=False)
        registry.install(args.kernels, device, kernels)
    gpucomm.init_process_group(transport="cuda_ipc", kernels=args.kernels, timeout=300)
    count = max(1, args.bytes // 4)
    t = torch.full((count,), float(rank + 1), device=device)
    stream = torch.cuda.current_stream(device)

    def eager() -> tuple[float, float]:
        gpucomm.barrier()
        stream.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        wall = time.perf_counter()
        for _ in range(args.iters):
            gpucomm.all_reduce(t)
        host = time.perf_counter() - wall
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / args.iters, host * 1e6 / args.iters

    def torch_launch() -> float:
        """Host time per call of a plain torch launch on the same tensor (``add_(0)``).

        What this host's CPU, driver and MPS ask of any launch, beside which gpucomm's eager call is read.
        """
        stream.synchronize()
        wall = time.perf_counter()
        for _ in range(args.iters):
            t.add_(0)
        host = time.perf_counter() - wall
        stream.synchronize()
        return host * 1e6 / args.iters

    bare = _bare_launch(device) if args.launch == "bound" else None
    raw_stream = torch.cuda.current_stream(device).cuda_stream

    def launcher_launch() -> float | None:
        """Host time per call of a bare launch through gpucomm's launcher (None: none here)."""
        if bare is None:
            return None
        launch = bare[0].launch
        stream.synchronize()
        wall = time.perf_counter()
        for _ in range(args.iters):
            launch(raw_stream)
        host = time.perf_counter() - wall
        stream.synchronize()
        return host * 1e6 / args.iters

    # Warm-up on a side stream, as torch.cuda.graph asks: the program is built and its kernel
    # compiled before the capture.
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        for _ in range(3):
            gpucomm.all_reduce(t)
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(args.per_graph):
            gpucomm.all_reduce(t)

    def replayed(graph: torch.cuda.CUDAGraph) -> float:
        gpucomm.barrier()
        stream.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(args.replays):
            graph.replay()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / (args.replays * args.per_graph)

    eager()  # first burst: the eager path's bindings and the fast path's entry
    torch_launch()  # its kernel loaded once
    launcher_launch()
    rounds: dict[str, list[float]] = {
        "eager_device_us": [],
        "eager_host_us": [],
        "graph_us": [],
        "torch_launch_host_us": [],
        "launcher_host_us": [],
    }
    for r in range(args.rounds):
        for mode in ("eager", "graph") if r % 2 == 0 else ("graph", "eager"):
            if mode == "eager":
                device_us, host_us = eager()
                rounds["eager_device_us"].append(device_us)
                rounds["eager_host_us"].append(host_us)
                rounds["torch_launch_host_us"].append(torch_launch())
                bare_us = launcher_launch()
                if bare_us is not None:
                    rounds["launcher_host_us"].append(bare_us)
            else:
                rounds["graph_us"].append(replayed(graph))
    # Every call summed into t over and over: refill it, then check one more call exactly.
    P = world
    check_after(lambda: t.fill_(float(rank + 1)), lambda: gpucomm.all_reduce(t), device)
    ok = bool(torch.equal(t, torch.full_like(t, P * (P + 1) / 2)))
    del graph
    gpucomm.destroy_process_group()
    results.put((rank, {"rounds": rounds, "check": ok}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gpucomm._bench.gpu_latency",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn")
    p.add_argument("--bytes", type=int, default=8, help="bytes per rank (fp32)")
    p.add_argument("--kernels", default="triton", choices=("triton", "cuda"), help="the program kernel")
    p.add_argument(
        "--launch",
        default="bound",
        choices=("bound", "jit"),
        help="the program kernel's launch: gpucomm's launcher, or Triton's JIT dispatch / CuPy's Function",
    )
    p.add_argument("--iters", type=int, default=1000, help="eager calls per burst")
    p.add_argument("--per-graph", type=int, default=100, help="calls captured into the graph")
    p.add_argument("--replays", type=int, default=20, help="graph replays per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each mode, alternating")
    p.add_argument("--json", default=None, metavar="FILE", help="write settings and every round's figures")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_latency: needs a CUDA device; torch sees none here", file=sys.stderr)
        return 2
    per_rank = spawn_ranks(_rank, args.nproc, args, timeout=900)
    names = ["eager_device_us", "eager_host_us", "graph_us", "torch_launch_host_us"]
    if all(len(per_rank[r]["rounds"]["launcher_host_us"]) == args.rounds for r in per_rank):
        names.append("launcher_host_us")
    figures = {
        name: [slowest_rank([[per_rank[r]["rounds"][name][k]] for r in per_rank]) for k in range(args.rounds)]
        for name in names
    }
    checks = all(per_rank[r]["check"] for r in per_rank)
    print(
        f"# all_reduce of {args.bytes} B, {args.nproc} ranks, kernels {args.kernels}, launch {args.launch}, "
        f"{torch.cuda.get_device_name()}; "
        f"median [min-max] over {args.rounds} rounds, slowest rank, us per call"
    )
    for name, values in figures.items():
        print(f"{name:>16}  {statistics.median(values):8.2f}  [{min(values):.2f}-{max(values):.2f}]")
    print(f"# check: {'PASS' if checks else 'FAIL'}")
    if args.json:
        medians = {name: statistics.median(values) for name, values in figures.items()}
        results = [
            {
                "launch": args.launch,
                "kernels": args.kernels,
                "median_us": medians["eager_host_us"],
                "what": "eager host time per call",
            },
            {
                "launch": args.launch,
                "kernels": args.kernels,
                "median_us": medians["eager_device_us"],
                "what": "eager device time per call",
            },
            {
                "launch": args.launch,
                "kernels": args.kernels,
                "median_us": medians["graph_us"],
                "what": "graph replay time per call",
            },
            {
                "launch": "torch",
                "kernels": "torch",
                "median_us": medians["torch_launch_host_us"],
                "what": "host time per torch add_ launch, the same tensor",
            },
        ]
        if "launcher_host_us" in medians:
            results.append(
                {
                    "launch": "bound",
                    "kernels": "cuda",
                    "median_us": medians["launcher_host_us"],
                    "what": "host time per bare launch through gpucomm's launcher (a prepared 16-byte copy)",
                }
            )
        for entry in results[:3]:  # gpucomm's own figures: wrong where the checked call was
            entry["wrong"] = not checks
        write_json(
            args.json,
            run_settings(args, device=torch.cuda.get_device_name()),
            rounds_us=figures,
            check=checks,
            results=results,
        )
    return 0 if checks else 1


if __name__ == "__main__":
    sys.exit(main())
