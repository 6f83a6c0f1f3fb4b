"""The nccl-tests options gpucomm-bench does not model, each refused with a line that says why.

nccl-tests' options (its ``--help``) that gpucomm-bench runs as nccl-tests does: ``-b -e -f -i -n
-w -c -o -d -r -G -T`` (``-o all`` and ``-d all`` too). ``-a 3`` (the slowest rank's time) is the
bench's own convention and is accepted; the rest of ``-a``, and the options below, would change
what a row means, or have no counterpart in a run of one rank per process. They are parsed, so that
a command line copied from nccl-tests stops with the reason, not with argparse's "unrecognized
arguments".
"""

from __future__ import annotations

import argparse

__all__ = ["add_nccl_flags", "check_nccl_flags", "REFUSED"]

# (short, long, why it is refused; "" where some values are accepted: see check_nccl_flags)
REFUSED = (
    (
        "-t",
        "--nthreads",
        "gpucomm-bench runs one rank per process: use --nproc (or torchrun) for more ranks, "
        "--cpu-threads for torch's threads per rank",
    ),
    ("-g", "--ngpus", "each rank drives one device: use --nproc (or torchrun) for one rank per GPU"),
    ("-m", "--agg_iters", "each timed iteration is one call; calls are not aggregated into groups"),
    ("-p", "--parallel_init", "ranks are processes, and they always initialise in parallel"),
    ("-y", "--stream_null", "each backend's calls run on the current stream; the default stream is not selectable"),
    (
        "-C",
        "--report_cputime",
        "time is CUDA events on a GPU and the wall clock on CPU, one or the other; "
        "bench/host_time.py measures the host's time of a call",
    ),
    ("-R", "--local_register", "gpucomm-bench registers no user buffers with a backend"),
    ("-N", "--run_cycles", "use --rounds: each round measures every size again, backends in alternating order"),
    ("-z", "--blocking", ""),
    ("-a", "--average", ""),
)


def add_nccl_flags(p: argparse.ArgumentParser) -> None:
    """nccl-tests' options with no counterpart here: parsed, then refused by check_nccl_flags."""
    group = p.add_argument_group("nccl-tests options that are refused with the reason (or accepted values)")
    for short, long, why in REFUSED:
        help_text = {
            "-z": "0 only: calls are timed back to back, one synchronize after them (nccl-tests' -z 0)",
            "-a": "3 only: each iteration's time is the slowest rank's (nccl-tests' -a 3)",
        }.get(short, f"refused: {why}")
        group.add_argument(short, long, default=None, metavar="N", help=f"{help_text} (default: not given)")


def check_nccl_flags(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first option given that gpucomm-bench does not run, and why."""
    for short, long, why in REFUSED:
        value = getattr(args, long.lstrip("-"))
        if value is None:
            continue
        if short == "-z" and value.strip() == "0":
            continue
        if short == "-a" and value.strip() == "3":
            continue
        if short == "-z":
            why = "only 0: calls are timed back to back with one synchronize after them (nccl-tests' -z 0)"
        if short == "-a":
            why = (
                "only 3: each iteration's time is the slowest rank's, as a collective ends with its last rank; "
                "each rank's own median is in the JSON (rank_time_us)"
            )
        raise ValueError(f"gpucomm-bench: {short}/{long} {value}: not run here: {why}")
