"""The README's first command, ``gpucomm-demo --nproc 4``, runs clean: every check OK and no rank
aborting at exit.

Before gpucomm stopped its watchdog thread when the last communicator closed (and at exit), a
rank could end while that thread was inside a torch call, and the process printed "terminate
called without an active exception" (once per rank in most runs): 4 of 5 runs of the demo, and
1 to 4 lines in 1 of 3 to 3 of 7 runs of the small form below, on the 2-core CI machine with
other work beside. The runs go two at a time to keep the test near a minute (one run of the
small form takes 8-25 s there); the small form (7 elements, one timed call) exercises the same
paths, groups and teardown as the default one.
"""

from __future__ import annotations

import os
import subprocess
import sys

RUNS = 10
AT_ONCE = 2


def _start() -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_", "WORLD_SIZE", "MASTER_", "GPUCOMM_", "OMP_"))}
    command = [sys.executable, "-m", "gpucomm.demo", "--nproc", "4", "--size", "7", "--iters", "1", "--timeout", "240"]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_demo_runs_clean_ten_times() -> None:
    failures = []
    for batch in range(0, RUNS, AT_ONCE):
        procs = [_start() for _ in range(batch, min(RUNS, batch + AT_ONCE))]
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            aborted = [line for line in (out + err).splitlines() if "terminate called" in line]
            if proc.returncode != 0 or aborted or not out.rstrip().endswith("OK"):
                failures.append(f"exit {proc.returncode}, {len(aborted)} 'terminate called' lines:\n{out[-1500:]}\n{err[-1500:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs:\n" + "\n---\n".join(failures)
