"""Start the ranks of a benchmark run.

``--nproc P`` local processes (spawn, a free port, env://), or, when RANK and WORLD_SIZE are
already set (torchrun), this process is one rank.

Spawned ranks are bound to one core each when there are enough (``--bind auto``, as ``mpirun``
binds its ranks): unbound, the scheduler sometimes wakes two ranks on one core after a gloo
call and leaves them there for milliseconds, because spinning waiters look cache-hot to its
balancer. On the 2-core CI machine, 2 ranks alternating 13 gpucomm and 13 gloo all_reduces of
8 B, 1000 times: 2027 of 13000 gpucomm calls over 80 us unbound (whole bursts at 110-140 us,
near the 105-113 us of both ranks pinned to one core), 1077 bound (nearly all the first call
after gloo's, which waits for the later rank); medians 26.9 and 26.1 us. Both backends run under the same
binding, and the header lists each rank's cores.

Each spawned rank runs as many torch threads as it has cores (bench/threads.py), and the header
and the JSON say how many. Binding holds the rank's own thread (and torch's, which it starts): the
threads its backends start for themselves (gloo's I/O) run on every core the bench was given
(bench/service_threads.py).
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import time

from .backends import nccl_spawn_env
from .ranks import rank_env
from .runner import Settings, run_rank
from .service_threads import spread_over
from .threads import apply_threads, plan_threads

__all__ = ["BIND_MODES", "launch", "under_launcher"]

BIND_MODES = ("auto", "none", "core")

# After one rank fails its peers usually block on it; give them this long to report their own
# error before they are terminated.
FAIL_GRACE_S = 10.0


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cores_for(nproc: int, bind: str) -> list[set[int] | None]:
    """The cores each spawned rank may run on (None: as inherited)."""
    if bind not in BIND_MODES:
        raise ValueError(f"gpucomm-bench: --bind expects one of {list(BIND_MODES)}, got {bind!r}")
    cores = sorted(os.sched_getaffinity(0))
    if bind == "none" or (bind == "auto" and nproc > len(cores)):
        return [None] * nproc
    if nproc > len(cores):
        raise ValueError(f"gpucomm-bench: --bind core needs a core per rank: {nproc} ranks, {len(cores)} cores")
    return [{cores[r]} for r in range(nproc)]


def _rank_main(
    rank: int,
    world: int,
    port: int,
    settings: Settings,
    cores: set[int] | None,
    env: dict[str, str],
) -> None:
    if cores is not None:
        # The backends' own threads may run on every core the bench has (bench/service_threads.py).
        spread_over(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cores)
    # Before any backend starts: torch's thread count for this rank's cores (bench/threads.py).
    apply_threads(*plan_threads(cores, world, settings.threads))
    os.environ.update(env)  # what the backends read when they start (backends.nccl_spawn_env)
    rank_env(rank, world, port)
    try:
        code = run_rank(settings)
    except ValueError as err:
        # Bad settings are found by every rank alike: one line from rank 0, not P tracebacks.
        if rank == 0:
            print(err, file=sys.stderr)
        code = 2
    sys.exit(code)


def launch(settings: Settings, nproc: int) -> int:
    """Run every rank; the exit status: 0 if all passed, 1 on a failed check, 2 on bad settings."""
    if under_launcher():
        if settings.threads is not None:
            apply_threads(settings.threads, "--cpu-threads")
        return run_rank(settings)
    if nproc < 1:
        raise ValueError(f"gpucomm-bench: --nproc must be >= 1, got {nproc}")
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    cores = _cores_for(nproc, settings.bind)
    env = nccl_spawn_env(settings.backends, settings.device, nproc)
    procs = [ctx.Process(target=_rank_main, args=(r, nproc, port, settings, cores[r], env)) for r in range(nproc)]
    for p in procs:
        p.start()
    failed_at = None
    while any(p.is_alive() for p in procs):
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > FAIL_GRACE_S:
            for p in procs:
                if p.is_alive():
                    print(
                        f"gpucomm-bench: terminating rank {procs.index(p)} after another rank failed", file=sys.stderr
                    )
                    p.terminate()
        time.sleep(0.1)
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    return 0 if all(c == 0 for c in codes) else max(c if c and c > 0 else 1 for c in codes)
