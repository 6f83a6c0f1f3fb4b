"""Timeouts out of range are a ValueError naming the function and the value, wherever they enter."""

from __future__ import annotations

import datetime
import math

from spawn import run_ranks

# Each is refused everywhere: not a positive, finite number of seconds that a thread can wait.
BAD = [math.inf, -math.inf, math.nan, 1e300, 10**20, 10**400, datetime.timedelta.max, 0, 0.0, -1, -0.5]
BAD_TEXT = ["inf", "nan", "1e300", "100000000000000000000", "0", "-1", "soon"]


def _refused(call, fn: str, shown: str) -> str | None:
    """None where ``call()`` raises ValueError naming ``fn`` and ``shown``; else what happened."""
    try:
        call()
    except ValueError as err:
        if f"gpucomm.{fn}:" in str(err) and shown in str(err):
            return None
        return f"ValueError without {fn!r} and {shown!r}: {err}"
    except Exception as err:  # noqa: BLE001 - the test reports whatever else came out
        return f"{type(err).__name__}: {err}"
    return "nothing raised"


def _every_entry(rank: int, world_size: int) -> list[str]:
    import os

    import torch
    import torch.distributed as dist

    import gpucomm
    from gpucomm.comm.communicator import Communicator
    from gpucomm.config import Config

    problems = []

    def check(where: str, call, fn: str, shown: str) -> None:
        found = _refused(call, fn, shown)
        if found is not None:
            problems.append(f"{where}: {found}")

    for value in BAD:
        shown = repr(value)
        check(
            f"init_process_group(timeout={shown})",
            lambda value=value: gpucomm.init_process_group(timeout=value, store=dist.HashStore(), rank=0, world_size=1),
            "init_process_group",
            shown,
        )
        check(
            f"Communicator(timeout={shown})",
            lambda value=value: Communicator(dist.HashStore(), 0, 1, config=Config(transport="gloo", timeout=value)),
            "Communicator",
            shown,
        )
    for text in BAD_TEXT:
        os.environ["GPUCOMM_TIMEOUT"] = text
        check(
            f"GPUCOMM_TIMEOUT={text}",
            lambda: gpucomm.init_process_group(store=dist.HashStore(), rank=0, world_size=1),
            "init_process_group",
            repr(text),
        )
    del os.environ["GPUCOMM_TIMEOUT"]
    if gpucomm.is_initialized():
        problems.append("a refused init left the world initialized")
        gpucomm.destroy_process_group()

    gpucomm.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=20)
    comm = gpucomm.get_default_communicator()
    work = gpucomm.all_reduce(torch.ones(4), async_op=True)
    for value in BAD:
        shown = repr(value)
        check(
            f"new_group(timeout={shown})", lambda value=value: gpucomm.new_group([0], timeout=value), "new_group", shown
        )
        check(
            f"Communicator.new_subgroup(timeout={shown})",
            lambda value=value: comm.new_subgroup([0], timeout=value),
            "new_group",
            shown,
        )
        check(
            f"monitored_barrier(timeout={shown})",
            lambda value=value: gpucomm.monitored_barrier(timeout=value),
            "monitored_barrier",
            shown,
        )
        if value != 0:  # zero is torch's kNoTimeout for Work.wait: the communicator's own timeout
            check(f"Work.wait(timeout={shown})", lambda value=value: work.wait(timeout=value), "Work.wait", shown)
    try:  # what torch's Work.wait passes by default, and a timeout in range
        work.wait(timeout=datetime.timedelta(0))
        work.wait(timeout=5.0)
    except Exception as err:  # noqa: BLE001 - reported with the rest
        problems.append(f"Work.wait with a timeout in range: {type(err).__name__}: {err}")
    gpucomm.destroy_process_group()
    return problems


def test_out_of_range_timeouts_are_value_errors_naming_the_function_and_the_value() -> None:
    """inf, 1e300, 10**20, timedelta.max, nan, zero and negatives, through init_process_group,
    GPUCOMM_TIMEOUT, Communicator, new_group, Communicator.new_subgroup, monitored_barrier and
    Work.wait (before: an OverflowError from timedelta or threading, or a call that ran)."""
    (problems,) = run_ranks(_every_entry, 1, timeout=120)
    assert not problems, "\n".join(problems)
