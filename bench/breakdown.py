"""Where an all_reduce's device time goes: its program with steps left out, one REDUCE by channels, pull
against push.

Ranks on one GPU over the CUDA IPC workspace (``--device cuda``), with gpucomm's own program kernel
(``--kernels triton`` or ``cuda``), run through the engine's executor:

(a) **Steps.** The all_reduce's real program (the algorithm ``auto`` runs on GPUs, built as the
    engine builds it: one-shot at 8 B and 64 KiB, whose small path runs one-shot's steps in a kernel
    of its own) at each ``--step-sizes``, and four variants of it (bench/breakdown_programs.py):
    without its REDUCEs, without its COPYs, without its SYNCs, and with nothing to move (one COPY of
    no bytes: the launch alone). Each is captured into a CUDA graph (``--iters`` calls) and replayed ``--replays`` times
    between CUDA events, ``--rounds`` rounds in alternating order; a figure is per replay the
    slowest rank, the median over replays and rounds (:func:`timing.slowest_rank`). The split:
    launch = empty; copy, SYNC and reduce = full less the variant without them. Only ``full``
    computes an all_reduce, and only it is checked (after every replay: input refilled, one more
    call, exact); the other rows read ``unchecked``.
(b) **One REDUCE over the peers' halves** by channels: every rank's data staged in its half, then
    one REDUCE of every rank's half, in rank order, into a tensor (P sources, P - 1 of them a
    peer's), at each ``--channels`` (a subgroup with GPUCOMM_CHANNELS of that count, so every launch
    runs that many) and each ``--sizes``; GB/s counts the bytes read and written, (P + 1) x size.
    Checked once after the timed calls (output poisoned, exact).
(c) **Pull against push**, at ``--copy-channels`` and each ``--sizes``: a COPY of the next rank's
    half into a tensor, against a COPY of a tensor into the next rank's half; the same bytes, the
    same channels; each checked (the push where it lands, its half poisoned first).

Two ranks sharing one GPU: "the peer" is then this GPU's own HBM, not NVLink; with MPS their
kernels run at once and share it, without MPS they take turns (``--mps``, which
bench/gpu_check.sh passes, is recorded in the header and the JSON). The last line gives the
model's inputs as this run measured them, for ``python -m gpucomm._bench.model``: ``--launch-us``
(the empty program at the smallest step size), ``--sync-us`` (the SYNC's share there) and
``--saturating-grid`` (the fewest channels whose REDUCE rate is within 5% of the best, at the
largest size every channel count ran).

``--device cpu`` runs the same programs over the shared-memory workspace, with Triton's interpreter
(TRITON_INTERPRET=1) or the CUDA C++ kernels built for the host (GPUCOMM_CUDA_EMULATE=1), timed call
by call without graphs: the checks mean what they mean on a GPU, the times nothing.

Example::

    python -m gpucomm._bench.breakdown --nproc 2 --kernels triton --mps on --json breakdown.json
    TRITON_INTERPRET=1 python -m gpucomm._bench.breakdown --device cpu --sizes 16K --channels 1 2 \\
        --copy-channels 2 --iters 2 --replays 1 --rounds 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence

from .hostinfo import run_settings, write_json
from .ranks import spawn_ranks
from .sizes import parse_size
from .timing import slowest_rank

__all__ = ["main", "run", "parser", "split", "saturating_grid", "model_flags", "WITHIN"]

# The saturating grid: the fewest channels whose rate is within this share of the best one's (a
# rate 5% short of the best is within two rounds' spread of it on the 2026-11-25 H100 run's kernel
# roofline: 2.91-3.07 TB/s for the same copy).
WITHIN = 0.05


def split(us: Mapping[str, float]) -> dict[str, float]:
    """The full program's time by step, from the variants' times (us): the launch is the empty
    program's; copy, sync and reduce are the full program's less the variant without them."""
    missing = sorted({"full", "no_reduce", "no_copy", "no_sync", "empty"} - set(us))
    if missing:
        raise ValueError(f"split: expected a time for every variant, missing {missing}")
    full = us["full"]
    return {
        "launch": us["empty"],
        "copy": full - us["no_copy"],
        "sync": full - us["no_sync"],
        "reduce": full - us["no_reduce"],
    }


def saturating_grid(rates: Mapping[int, float], within: float = WITHIN) -> int:
    """The fewest channels whose rate is within ``within`` of the best rate of ``rates``
    ({channels: GB/s})."""
    if not rates or not 0 <= within < 1:
        raise ValueError(f"saturating_grid: expected rates and 0 <= within < 1, got {dict(rates)} and {within}")
    best = max(rates.values())
    return min(g for g, rate in rates.items() if rate >= (1 - within) * best)


def model_flags(launch_us: float, sync_us: float, grid: int | None) -> str:
    """The model's inputs (bench/model.py's options) as a command line's flags."""
    flags = f"--launch-us {launch_us:.2f} --sync-us {sync_us:.2f}"
    return flags if grid is None else f"{flags} --saturating-grid {grid}"


def _figure(per_rank: Sequence[Mapping], get: Callable[[Mapping], list[list[float]]]) -> float:
    """Microseconds of one row: in each round, per sample (a replay, or a call on the CPU) the slowest
    rank's time and the median over samples (timing.slowest_rank); then the median over rounds."""
    rounds = [get(ranked) for ranked in per_rank]
    return 1e6 * statistics.median(slowest_rank([r[i] for r in rounds]) for i in range(len(rounds[0])))


def _wrong(per_rank: Sequence[Mapping], get: Callable[[Mapping], int]) -> int:
    return sum(get(ranked) for ranked in per_rank)


_LETTERS = {1: "C", 2: "R", 3: "S"}  # COPY, REDUCE, SYNC (gpucomm.ops.instruction_set)


def _report(args: argparse.Namespace, per_rank: list[Mapping], header: list[str]) -> dict:
    """The tables on stdout; the rows, the split and the model's flags, for the JSON."""
    P = args.nproc
    print("\n".join(f"# {line}" for line in header))
    steps, splits, reduce_rows, copy_rows = [], {}, [], []
    print("#\n# (a) the all_reduce's program, steps left out (C COPY, S SYNC, R REDUCE; empty: one COPY of no bytes,")
    print("#     the launch alone); us per call; only full computes an all_reduce, the others are unchecked")
    print(f"# {'size':>10}  {'algo':>8}  {'variant':>9}  {'steps':>8}  {'time(us)':>9}  check")
    for size in args.step_sizes:
        cell = [ranked["steps"][str(size)] for ranked in per_rank]
        us = {}
        for variant, kinds in cell[0]["instructions"].items():
            us[variant] = _figure(cell, lambda c, v=variant: c["rounds"][v])
            wrong = _wrong(cell, lambda c: c["wrong"]) if variant == "full" else None
            check = "unchecked" if wrong is None else ("OK" if wrong == 0 else f"WRONG ({wrong} elements)")
            letters = "".join(_LETTERS[k] for k in kinds) or "-"
            print(f"  {size:>10}  {cell[0]['algo']:>8}  {variant:>9}  {letters:>8}  {us[variant]:9.2f}  {check}")
            steps.append({"size": size, "algo": cell[0]["algo"], "variant": variant, "steps": letters,
                          "time_us": us[variant], "wrong": wrong})  # fmt: skip
        splits[size] = split(us)
        print("#   split: " + ", ".join(f"{k} {v:.2f} us" for k, v in splits[size].items()))
    if args.sizes:
        print(f"#\n# (b) one REDUCE of every rank's half ({P} sources, {P - 1} a peer's); GB/s = (P + 1) x size / time")
        print(f"# {'size':>10}  {'channels':>8}  {'time(us)':>9}  {'GB/s':>8}  {'#wrong':>6}")
    for size in args.sizes:
        for g in args.channels:
            cell = [ranked["reduce"][str(g)][str(size)] for ranked in per_rank]
            t = _figure(cell, lambda c: c["rounds"])
            row = {"size": size, "channels": g, "time_us": t, "gbps": (P + 1) * size / t / 1e3,
                   "wrong": _wrong(cell, lambda c: c["wrong"])}  # fmt: skip
            reduce_rows.append(row)
            print(f"  {size:>10}  {g:>8}  {t:9.2f}  {row['gbps']:8.2f}  {row['wrong']:>6}")
    if args.sizes:
        print(
            f"#\n# (c) a COPY from the next rank's half (pull) against one into it (push), "
            f"{args.copy_channels} channels"
        )
        print(f"# {'size':>10}  {'channels':>8}  {'copy':>5}  {'time(us)':>9}  {'GB/s':>8}  {'#wrong':>6}")
    for size in args.sizes:
        for way in ("pull", "push"):
            cell = [ranked["copy"][str(size)][way] for ranked in per_rank]
            t = _figure(cell, lambda c: c["rounds"])
            row = {"size": size, "channels": args.copy_channels, "copy": way, "time_us": t,
                   "gbps": size / t / 1e3, "wrong": _wrong(cell, lambda c: c["wrong"])}  # fmt: skip
            copy_rows.append(row)
            print(f"  {size:>10}  {args.copy_channels:>8}  {way:>5}  {t:9.2f}  {row['gbps']:8.2f}  {row['wrong']:>6}")
    smallest = splits[min(args.step_sizes)]
    grid, at = None, None
    if args.sizes:  # every channel count ran every size: the largest is nearest the asymptote
        at = max(args.sizes)
        grid = saturating_grid({r["channels"]: r["gbps"] for r in reduce_rows if r["size"] == at})
    flags = model_flags(smallest["launch"], smallest["sync"], grid)
    print(f"#\n# model flags ({'measured on this GPU' if args.device == 'cuda' else 'CPU run: not model inputs'}):")
    print(f"#   launch: the empty program at {min(args.step_sizes)} B; sync: full less no_sync there", end="")
    print(
        f"; saturating grid: the fewest channels within {WITHIN:.0%} of the best REDUCE rate at {at} B" if grid else ""
    )
    print(f"model flags: {flags}")
    return {"steps": steps, "split_us": {str(k): v for k, v in splits.items()}, "reduce": reduce_rows,
            "copy": copy_rows, "model_flags": flags, "saturating_grid_at": at}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gpucomm._bench.breakdown",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (all on one GPU: rank %% GPUs)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where the tensors and workspace live")
    p.add_argument("--kernels", default="triton", choices=("triton", "cuda"), help="the program kernel")
    p.add_argument("--step-sizes", type=parse_size, nargs="+", default=[8, 64 << 10], help="(a)'s all_reduce sizes")
    p.add_argument("--sizes", type=parse_size, nargs="*", default=[1 << 20, 16 << 20, 256 << 20],
                   help="(b) and (c)'s sizes (none: skip them)")  # fmt: skip
    p.add_argument("--channels", type=int, nargs="+", default=[1, 4, 16, 32], help="(b)'s channel counts")
    p.add_argument("--copy-channels", type=int, default=16, help="(c)'s channels: one of --channels")
    p.add_argument("--iters", type=int, default=20, help="calls per graph (on the CPU: timed calls)")
    p.add_argument("--replays", type=int, default=10, help="graph replays, a sample each (GPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before each measurement")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each measurement, alternating order")
    p.add_argument("--timeout", type=float, default=60.0, help="gpucomm's timeout (s) for every wait")
    p.add_argument("--mps", default="unknown", choices=("on", "off", "unknown"), help="whether MPS runs (recorded)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the settings and every row")
    return p


def _check(args: argparse.Namespace) -> None:
    """Refuse what cannot run, before any rank starts (ValueError naming the option)."""
    if args.nproc < 2:
        raise ValueError(f"breakdown: --nproc must be at least 2 (a peer to read), got {args.nproc}")
    for name in ("iters", "replays", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"breakdown: --{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 1:
        raise ValueError(f"breakdown: --warmup must be at least 1 (a capture follows one), got {args.warmup}")
    if any(g < 1 or g > 64 for g in args.channels):
        raise ValueError(f"breakdown: --channels must be in [1, 64] (gpucomm.config), got {args.channels}")
    if args.sizes and args.copy_channels not in args.channels:
        raise ValueError(
            f"breakdown: --copy-channels must be one of --channels {args.channels}, got {args.copy_channels}"
        )
    if any(s < 16 or s % 16 for s in args.sizes):
        raise ValueError(f"breakdown: --sizes must be whole 16-byte vectors, got {args.sizes}")
    if any(s < 1 for s in args.step_sizes):
        raise ValueError(f"breakdown: --step-sizes must be positive, got {args.step_sizes}")


def _device(args: argparse.Namespace) -> tuple[object, str, dict]:
    """The parent's view of the device the ranks use: the device, its name, the versions (CuPy's too)."""
    import torch

    from .hostinfo import device_name, versions

    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    found = versions()
    try:
        import cupy

        found["cupy"] = cupy.__version__
    except ImportError:
        found["cupy"] = None
    return device, device_name(device), found


def _header(args: argparse.Namespace, device: object, name: str, found: dict) -> list[str]:
    lines = [
        f"gpucomm breakdown: {args.nproc} ranks, kernels {args.kernels}, device {device} [{name}], MPS {args.mps}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in found.items()),
    ]
    if args.device == "cuda":
        lines += [
            f"every rank on this one GPU: 'the peer' is this GPU's own HBM, not NVLink; MPS {args.mps} "
            "(with MPS the ranks' kernels run at once and share the GPU, without it they take turns)",
            f"time: {args.iters} calls captured into a CUDA graph, replayed {args.replays} times between CUDA events "
            f"(fewer calls above 4 MiB); per replay the slowest rank, median over replays and {args.rounds} rounds",
        ]
    else:
        lines += [
            "CPU run: the programs over the shared-memory workspace, the kernels interpreted (Triton) or built for "
            "the host (CUDA C++); the checks hold, THE TIMES MEAN NOTHING for a GPU",
            f"time: wall clock per call, {args.iters} calls (fewer above 4 MiB); per call the slowest rank, median "
            f"over calls and {args.rounds} rounds",
        ]
    return lines


def run(args: argparse.Namespace, rank: Callable | None = None) -> int:
    """Measure as ``args`` say; 0 when every check passed, 1 otherwise. ``rank``: what each rank runs
    (bench/breakdown_rank.py's ``rank_main`` unless given)."""
    from .breakdown_rank import rank_main

    _check(args)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("breakdown: --device cuda needs a CUDA device; torch sees none here", file=sys.stderr)
            return 2
    else:
        from gpucomm.ops.registry import kernels_run_on_cpu

        if not kernels_run_on_cpu(args.kernels):
            need = "TRITON_INTERPRET=1" if args.kernels == "triton" else "GPUCOMM_CUDA_EMULATE=1"
            print(f"breakdown: --device cpu --kernels {args.kernels} needs {need} in the environment", file=sys.stderr)
            return 2
    device, name, found = _device(args)
    header = _header(args, device, name, found)
    per_rank = spawn_ranks(rank or rank_main, args.nproc, args, timeout=3600)
    errors = {r: v["error"] for r, v in per_rank.items() if "error" in v}
    if errors:
        for r, text in sorted(errors.items()):
            print(f"# ERROR: rank {r}:\n{text}", file=sys.stderr)
        return 1
    report = _report(args, [per_rank[r] for r in sorted(per_rank)], header)
    checked = [row["wrong"] for row in report["steps"] if row["wrong"] is not None]
    checked += [row["wrong"] for row in report["reduce"] + report["copy"]]
    ok = not any(checked)
    print(f"# check: {'PASS' if ok else 'FAIL'} ({len(checked)} checked rows)")
    if args.json:
        settings = run_settings(args, device=name, versions=found, header=header)
        write_json(args.json, settings, **report, check=ok)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
