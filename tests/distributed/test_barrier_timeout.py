"""``barrier`` on a group with a timeout raises once it has passed, as gloo's does.

torch's own ``test_barrier_timeout_full_group`` (torch/testing/_internal/distributed/
distributed_test.py): a new group of every rank with a 1 s timeout; only rank 0 calls
``barrier`` on it, which must raise an error whose message matches
``" (Timed out|closed|timeout) "``, no earlier than the timeout (less 0.1 s). Here it runs the same
steps against torch.distributed's gloo backend and against the ``gpucomm`` backend, on each path
a gpucomm group can take for the barrier (the shared-memory workspace, its own gloo group).
"""

from __future__ import annotations

import re
import time

import pytest
from spawn import run_ranks

TIMEOUT_S = 1.0
# torch's test: assertRaisesRegex(Exception, " (Timed out|closed|timeout) ") and
# assertGreaterAlmostEqual(time.time(), expected_time, delta=0.1).
TORCH_PATTERN = " (Timed out|closed|timeout) "
DELTA_S = 0.1


def _barrier_alone(rank: int, world_size: int, backend: str, transport: str | None) -> tuple[str, float] | None:
    import datetime
    import os

    import torch.distributed as dist

    import gpucomm  # noqa: F401 - registers the gpucomm backend

    if transport is not None:
        os.environ["GPUCOMM_TRANSPORT"] = transport  # before the groups are built: read once by each
    dist.init_process_group(backend)
    group = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT_S))
    seen = None
    if rank == 0:
        expected = time.time() + TIMEOUT_S
        try:
            dist.barrier(group)
            seen = ("no error", 0.0)
        except Exception as err:  # noqa: BLE001 - torch's test accepts any exception type
            seen = (f"{type(err).__name__}: {err}", time.time() - expected)
    else:
        time.sleep(TIMEOUT_S + 3.0)  # alive (and absent from the barrier) until rank 0 has given up
    return seen


@pytest.mark.parametrize("backend,transport", [("gloo", None), ("gpucomm", "auto"), ("gpucomm", "gloo")])
def test_barrier_timeout_full_group(backend: str, transport: str | None) -> None:
    message, late = run_ranks(_barrier_alone, 2, backend, transport, timeout=120)[0]
    assert re.search(TORCH_PATTERN, message), message
    assert late >= -DELTA_S, f"raised {-late:.2f} s before the group's timeout: {message}"


def _all_reduce_alone(rank: int, world_size: int, async_op: bool) -> str | None:
    import datetime

    import torch
    import torch.distributed as dist

    import gpucomm  # noqa: F401 - registers the gpucomm backend

    dist.init_process_group("gpucomm")
    group = dist.new_group(timeout=datetime.timedelta(seconds=TIMEOUT_S))
    seen = None
    if rank == 0:
        try:
            work = dist.all_reduce(torch.ones(4), group=group, async_op=async_op)
            if work is not None:
                work.wait()
            seen = "no error"
        except Exception as err:  # noqa: BLE001 - which type is the next test's business
            seen = type(err).__name__
    else:
        time.sleep(TIMEOUT_S + 3.0)
    return seen


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
def test_every_collective_of_the_backend_raises_its_timeout(async_op: bool) -> None:
    """Not only barrier: a Work of the gpucomm backend raises from wait() when its collective
    failed (a Work made by torch's _create_work_from_future returned True with the error in its
    Future, torch 2.13)."""
    assert run_ranks(_all_reduce_alone, 2, async_op, timeout=120)[0] == "CommTimeoutError"
