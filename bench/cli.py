"""``gpucomm-bench``: collective and kernel benchmarks with nccl-tests' options and report.

Example::

    gpucomm-bench all_reduce -b 8 -e 128M -f 2 --nproc 4 --compare gloo,nccl --json out.json
    torchrun --nproc-per-node 8 -m gpucomm._bench.cli all -b 1K -e 1G -f 4
    gpucomm-bench kernels -b 4K -e 64M -f 4
"""

from __future__ import annotations

import argparse
import sys

import torch

from .backends import BACKENDS, DEFAULT_TIMEOUT_S, gpucomm_api_available
from .collectives import COLLECTIVES
from .combos import DTYPES, OPS
from .nccl_flags import add_nccl_flags, check_nccl_flags
from .sizes import linear_sweep, parse_size, size_sweep

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpucomm-bench",
        description="Collective benchmarks in the conventions of nccl-tests (sizes, algbw/busbw, "
        "out-of-place and in-place, #wrong), and kernel bandwidth against torch's copy.",
    )
    # Every option's help ends with its default: "%(default)s" where the value says it all, words
    # where the default depends on the host or on gpucomm.
    p.add_argument("test", choices=(*COLLECTIVES, "all", "kernels"), help="what to measure")
    p.add_argument(
        "-b", "--minbytes", type=parse_size, default="8", help="smallest size (8, 1K, 4M, 1G) (default: %(default)s)"
    )
    p.add_argument("-e", "--maxbytes", type=parse_size, default="32M", help="largest size (default: %(default)s)")
    p.add_argument("-f", "--stepfactor", type=float, default=None, help="size multiplier between rows (default: 2)")
    p.add_argument(
        "-i",
        "--stepbytes",
        type=parse_size,
        default=None,
        help="bytes added between rows, in place of -f's multiplier (default: none, -f's)",
    )
    p.add_argument(
        "-n", "--iters", type=int, default=20, help="timed iterations per size (median taken) (default: %(default)s)"
    )
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="untimed iterations first (default: %(default)s)")
    p.add_argument(
        "-G",
        "--cudagraph",
        type=int,
        default=0,
        metavar="LAUNCHES",
        help="capture the timed iterations into a CUDA graph and replay it this many times: the device's "
        "time per call without the host's enqueue in it; CUDA tensors, and backends whose calls can be "
        "captured (not gloo) (default: %(default)s, no graph)",
    )
    p.add_argument(
        "-c", "--check", type=int, choices=(0, 1), default=1, help="check results (1) or not (0) (default: %(default)s)"
    )
    p.add_argument(
        "-o",
        "--op",
        choices=(*OPS, "all"),
        default="sum",
        help="reduction of reducing collectives; all: each in turn (default: %(default)s)",
    )
    p.add_argument(
        "-d",
        "--datatype",
        choices=(*DTYPES, "all"),
        default="float",
        help="element type; all: each in turn (default: %(default)s)",
    )
    p.add_argument(
        "-r", "--root", type=int, default=0, help="root of broadcast, reduce, gather, scatter (default: %(default)s)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds per size of a collective test; each measures every backend once, in "
        "alternating order, and the median over rounds is reported with its min-max spread "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="local ranks to spawn; ignored under torchrun (default: one per GPU, or 2 on CPU)",
    )
    p.add_argument(
        "--bind",
        choices=("auto", "none", "core"),
        default="auto",
        help="cores of spawned ranks: core binds each to one core of its own, auto does so where "
        "there is a core per rank, none leaves them to the scheduler; the threads the backends start "
        "for themselves (gloo's I/O) run on every core (default: %(default)s)",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads per spawned rank (default: as many as the rank's cores under --bind; unbound, "
        "OMP_NUM_THREADS, else the cores shared among the ranks)",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=None,
        help="backend under test (default: gpucomm, or gloo where gpucomm's API is absent)",
    )
    p.add_argument(
        "--compare", default="", help="comma list of peers to run on the same sizes: gloo,nccl (default: none)"
    )
    knob = "(default: gpucomm's own: its GPUCOMM_{} variable, else auto)"
    p.add_argument("--transport", default=None, help=f"gpucomm knob: auto|shm|cuda_ipc|gloo {knob.format('TRANSPORT')}")
    p.add_argument("--kernels", default=None, help=f"gpucomm knob: auto|torch|triton|cuda {knob.format('KERNELS')}")
    p.add_argument(
        "--algo", default=None, help=f"gpucomm knob: auto|oneshot|twoshot|ring|tree|direct {knob.format('ALGO')}"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the tensors live; auto: CUDA if present (default: %(default)s)",
    )
    p.add_argument(
        "-T",
        "--timeout",
        type=float,
        default=None,
        help=f"seconds before a stuck collective fails (default: {DEFAULT_TIMEOUT_S:g}; "
        "gpucomm keeps its own, GPUCOMM_TIMEOUT or the same)",
    )
    p.add_argument("--seed", type=int, default=None, help="seed of the check inputs (default: random)")
    p.add_argument("--json", default=None, metavar="FILE", help="write settings and every row as JSON (default: none)")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="plot busbw and time against size (default: none)")
    add_nccl_flags(p)
    return p


def _backends(args: argparse.Namespace) -> list[str]:
    primary = args.backend or ("gpucomm" if gpucomm_api_available() else "gloo")
    compare = [c.strip() for c in args.compare.split(",") if c.strip()]
    unknown = [c for c in compare if c not in BACKENDS]
    if unknown:
        raise ValueError(f"gpucomm-bench: --compare expects names from {list(BACKENDS)}, got {unknown}")
    return list(dict.fromkeys([primary, *compare]))


def _check_cudagraph(args: argparse.Namespace) -> None:
    """-G's conditions, before any rank starts: a count, CUDA tensors, no gloo."""
    if args.cudagraph < 0:
        raise ValueError(f"gpucomm-bench: -G/--cudagraph must be >= 0 graph launches, got {args.cudagraph}")
    if args.device == "cpu" or not torch.cuda.is_available():
        where = "--device cpu" if args.device == "cpu" else "torch sees no CUDA device here"
        raise ValueError(f"gpucomm-bench: -G/--cudagraph replays a CUDA graph and needs CUDA tensors, got {where}")
    if args.test != "kernels" and "gloo" in _backends(args):
        raise ValueError(
            "gpucomm-bench: -G/--cudagraph captures every backend's calls into a CUDA graph, and gloo's "
            "cannot be captured (they copy through the host): drop gloo from --backend/--compare"
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gpucomm-bench``; returns the exit status (0 OK, 1 FAILED, 2 bad settings)."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        return _run(args, argv)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2


def _sizes(args: argparse.Namespace) -> list[int]:
    """-f's geometric sweep, or -i's linear one (not both: nccl-tests takes one step or the other)."""
    if args.stepbytes is None:
        return size_sweep(args.minbytes, args.maxbytes, 2.0 if args.stepfactor is None else args.stepfactor)
    if args.stepfactor is not None:
        raise ValueError(
            f"gpucomm-bench: -i/--stepbytes and -f/--stepfactor both given ({args.stepbytes}, {args.stepfactor}): "
            "pass one step"
        )
    return linear_sweep(args.minbytes, args.maxbytes, args.stepbytes)


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    check_nccl_flags(args)
    sizes = _sizes(args)
    if args.cpu_threads is not None and args.cpu_threads < 1:
        raise ValueError(f"gpucomm-bench: --cpu-threads must be >= 1, got {args.cpu_threads}")
    if args.rounds < 1:
        raise ValueError(f"gpucomm-bench: --rounds must be >= 1, got {args.rounds}")
    if args.cudagraph:
        _check_cudagraph(args)
    if args.test == "kernels":
        if "all" in (args.datatype, args.op):
            raise ValueError(
                f"gpucomm-bench: kernels measures one dtype and op per run, got -d {args.datatype} -o {args.op}"
            )
        from .kernels_bench import run_kernels

        return run_kernels(
            sizes,
            args.datatype,
            args.op,
            args.iters,
            args.warmup_iters,
            bool(args.check),
            args.device,
            args.json,
            args.plot,
            argv,
            graph_launches=args.cudagraph,
        )

    from .launch import launch
    from .runner import Settings

    knobs = {k: getattr(args, k) for k in ("transport", "kernels", "algo") if getattr(args, k) is not None}
    settings = Settings(
        collectives=list(COLLECTIVES) if args.test == "all" else [args.test],
        sizes=sizes,
        dtype=args.datatype,
        op=args.op,
        root=args.root,
        iters=args.iters,
        warmup=args.warmup_iters,
        check=bool(args.check),
        backends=_backends(args),
        knobs=knobs,
        device=args.device,
        timeout_s=args.timeout,
        seed=args.seed,
        json_path=args.json,
        plot_path=args.plot,
        argv=list(argv),
        step_factor=2.0 if args.stepfactor is None else args.stepfactor,
        step_bytes=args.stepbytes,
        max_bytes=args.maxbytes,
        rounds=args.rounds,
        bind=args.bind,
        graph_launches=args.cudagraph,
        threads=args.cpu_threads,
    )
    nproc = args.nproc
    if nproc is None:
        nproc = torch.cuda.device_count() if torch.cuda.is_available() and args.device != "cpu" else 2
    return launch(settings, nproc)


if __name__ == "__main__":
    sys.exit(main())
