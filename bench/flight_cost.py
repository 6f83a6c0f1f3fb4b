"""What the flight record costs a call, measured in one process without a peer.

A one-rank communicator on the shared-memory workspace with the torch kernels runs all_reduce
of 2 fp32 (8 bytes) in rounds that alternate between the communicator's real flight log and a
log whose hooks do nothing; each round times ``--calls`` calls by the thread's CPU time (other
processes on the machine do not count) and wall clock. Also timed alone: the call-site lookup
(a log whose ``entered`` only walks the frames to the caller's file:line, as the real one does
first) inside the same call, and one ``entered`` + ``completed`` pair alone. Medians over rounds.

The collective itself is cheaper here than across two ranks (no peer to wait for), so the share
it reports is an upper bound of the share on ``gpucomm-bench all_reduce --nproc 2 -b 8 -e 8``.

Example::

    OMP_NUM_THREADS=1 python -m gpucomm._bench.flight_cost --rounds 15 --json flight.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from gpucomm.flight import _UNSEEN

__all__ = ["main"]


class _Silent:
    """A flight log whose hooks do nothing: the baseline."""

    def entered(self, seq: int, fn: str, tensor: object, fields: dict[str, object]) -> int:
        return 0

    def completed(self, at: int) -> None:
        pass


class _SiteOnly(_Silent):
    """Only the call-site part of FlightLog.entered: the same walk and lookup, nothing written."""

    def __init__(self, log) -> None:
        self.log = log

    def entered(self, seq: int, fn: str, tensor: object, fields: dict[str, object]) -> int:
        log = self.log
        frame = sys._getframe(3)
        while frame is not None:
            sites = log._sites.get(id(frame.f_code), _UNSEEN)
            if sites is _UNSEEN:
                sites = log._classify(frame.f_code)
            if sites is not None:
                break
            frame = frame.f_back
        sites.get(frame.f_lasti)
        return 0


def _timed(fn, calls: int) -> tuple[float, float]:
    """(CPU µs, wall µs) per call of ``fn``."""
    cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.thread_time_ns() - cpu) / calls / 1e3, (time.perf_counter_ns() - wall) / calls / 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpucomm._bench.flight_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of each setting, alternating (default: 15)")
    parser.add_argument("--calls", type=int, default=3000, help="calls timed per round (default: 3000)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the settings and medians as JSON")
    args = parser.parse_args(argv)

    import torch

    import gpucomm
    from gpucomm.config import Config

    comm = gpucomm.Communicator(torch.distributed.HashStore(), 0, 1, config=Config.from_env(transport="shm", kernels="torch"))
    record, silent = comm._flight, _Silent()
    site_only = _SiteOnly(record)
    t = torch.ones(2)
    fields = {"op": "SUM"}

    def call() -> None:
        comm.all_reduce(t)

    def pair() -> None:
        record.completed(record.entered(1, "all_reduce", t, fields))

    for _ in range(200):
        call()
    samples: dict[str, list[tuple[float, float]]] = {"with record": [], "without": [], "call site only": [], "entered + completed": []}
    for _ in range(args.rounds):
        for name, log in (("with record", record), ("without", silent), ("call site only", site_only)):
            comm._flight = log
            samples[name].append(_timed(call, args.calls))
        comm._flight = record
        samples["entered + completed"].append(_timed(pair, args.calls))
    comm.close()

    medians = {name: {"cpu_us": statistics.median(s[0] for s in runs), "wall_us": statistics.median(s[1] for s in runs)} for name, runs in samples.items()}
    ratios = [w[0] / wo[0] for w, wo in zip(samples["with record"], samples["without"])]
    site_ratios = [s[0] / wo[0] for s, wo in zip(samples["call site only"], samples["without"])]
    result = {"medians": medians, "cpu_ratio_median": statistics.median(ratios), "site_cpu_ratio_median": statistics.median(site_ratios)}
    for name, m in medians.items():
        print(f"{name:22s} {m['cpu_us']:8.2f} us CPU  {m['wall_us']:8.2f} us wall")
    print(f"with / without (CPU, median of rounds' ratios): {result['cpu_ratio_median']:.3f}")
    print(f"call site only / without (CPU): {result['site_cpu_ratio_median']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {**vars(args), "argv": sys.argv[1:]}, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
