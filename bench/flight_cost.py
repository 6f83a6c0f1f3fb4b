"""What the flight record costs a call, measured in one process without a peer.

A one-rank communicator on the shared-memory workspace with the torch kernels runs a repeated
blocking all_reduce of 2 fp32 (8 bytes), the host's fast path, in rounds that alternate between
three flight logs: the communicator's own with the C writer (``kernels/host/flight_record.c``),
the same with the Python twin (:class:`gpucomm.reliability.flight.PyRecorder`, what a host without a C
compiler gets), and a log whose hooks do nothing. Each round times ``--calls`` calls by the
thread's CPU time (other processes on the machine do not count) and wall clock; also timed
alone, one ``again`` + ``completed`` pair of each writer. Medians over rounds, and the median of
the rounds' ratios to the silent log.

The collective itself is cheaper here than across two ranks (no peer to wait for), so the share
it reports is an upper bound of the share on ``gpucomm-bench all_reduce --nproc 2 -b 8 -e 8``.

Example::

    OMP_NUM_THREADS=1 python -m gpucomm._bench.flight_cost --rounds 15 --json flight.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from .hostinfo import run_settings, write_json

__all__ = ["main", "SilentFlightLog"]


class SilentFlightLog:
    """A flight log whose hooks on the host's fast path do nothing: the baseline."""

    def enter(self, seq: int, call: tuple) -> int:
        return 0

    def completed(self, at: int) -> None:
        pass


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
    from gpucomm.reliability.flight import _RING_AT, RING, FlightLog, PyRecorder, teach

    comm = gpucomm.Communicator(
        torch.distributed.HashStore(), 0, 1, config=Config.from_env(transport="shm", kernels="torch")
    )
    native = comm._flight
    if type(native.record.writer) is PyRecorder:
        raise SystemExit(
            "flight_cost: the C writer did not build here (see gpucomm.toolchain.native); nothing to compare"
        )
    record = native.record
    twin = PyRecorder(record._mine, _RING_AT, RING, lambda frame: teach(twin, record.intern, frame))
    python = FlightLog(record, native.group)
    python.enter, python.completed = twin.enter, twin.end
    logs = {"C writer": native, "Python writer": python, "without": SilentFlightLog()}
    t = torch.ones(2)
    call_fields = native.call("all_reduce", t, {"op": "SUM"})

    def call() -> None:
        comm.all_reduce(t)

    for _ in range(200):
        call()
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in [*logs, "C pair", "Python pair"]}
    for _ in range(args.rounds):
        for name, log in logs.items():
            comm._flight = log
            samples[name].append(_timed(call, args.calls))
        for name, log in (("C pair", native), ("Python pair", python)):
            samples[name].append(_timed(lambda log=log: log.completed(log.again(1, call_fields)), args.calls))
    comm._flight = native
    comm.close()

    medians = {
        name: {"cpu_us": statistics.median(s[0] for s in runs), "wall_us": statistics.median(s[1] for s in runs)}
        for name, runs in samples.items()
    }
    ratios = {
        name: statistics.median(w[0] / wo[0] for w, wo in zip(samples[name], samples["without"]))
        for name in ("C writer", "Python writer")
    }
    result = {"medians": medians, "cpu_ratio_median": ratios}
    for name, m in medians.items():
        print(f"{name:22s} {m['cpu_us']:8.2f} us CPU  {m['wall_us']:8.2f} us wall")
    for name, ratio in ratios.items():
        print(f"{name} / without (CPU, median of rounds' ratios): {ratio:.3f}")
    if args.json:
        write_json(args.json, run_settings(args), **result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
