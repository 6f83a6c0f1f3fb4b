"""The watchdog's cost: host time of one poll with N collectives in flight.

Works that have not ended (gpucomm Works over a pending part that says it has not ended) are
handed to a fresh watchdog, in one queue (one stream) or spread over several, and one poll is
timed, many times: the median and the 90th percentile in microseconds. A poll should cost the
same whatever N is (it asks only the oldest work of each queue).

Example::

    python -m gpucomm._bench.watchdog_poll --works 600 1200 10000 --json watchdog.json
"""

from __future__ import annotations

import argparse

from gpucomm.reliability.watchdog import _Watchdog
from gpucomm.work import Work

from .hostinfo import run_settings, write_json
from .samples import each_call, median_p90_us

__all__ = ["main"]


class _NotEnded:
    """The pending part of a collective still in flight (an end event not reached yet)."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:  # never called: the watchdog does not wait
        raise AssertionError("the watchdog waited")


def poll_us(works: int, queues: int, polls: int) -> dict:
    """Median and p90 microseconds of one poll with ``works`` works in flight over ``queues``."""
    dog = _Watchdog()
    keys = [object() for _ in range(queues)]
    for i in range(works):
        dog.add(Work([_NotEnded()]), "all_reduce", 3600.0, lambda err: None, 0, keys[i % queues])
    return {"works": works, "queues": queues, **median_p90_us(each_call(dog.poll, polls))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpucomm._bench.watchdog_poll", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--works", type=int, nargs="+", default=[600, 1200, 10000], help="works in flight (default: %(default)s)"
    )
    parser.add_argument("--queues", type=int, default=1, help="streams they are spread over (default: %(default)s)")
    parser.add_argument("--polls", type=int, default=200, help="polls timed per count (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    args = parser.parse_args(argv)
    rows = [poll_us(n, args.queues, args.polls) for n in args.works]
    print(f"{'works':>8} {'queues':>6} {'median us':>10} {'p90 us':>8}")
    for row in rows:
        print(f"{row['works']:>8} {row['queues']:>6} {row['median_us']:>10.1f} {row['p90_us']:>8.1f}")
    if args.json:
        write_json(args.json, run_settings(args), results=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
