"""The host's fast path (gpucomm.workspace.repeat): a blocking all_reduce seen before skips the planning,
and gives the same results, the same errors and the same per-call records as the full path."""

from __future__ import annotations

import pytest
from spawn import run_ranks

from gpucomm.toolchain import native

INTERPRET = {"TRITON_INTERPRET": "1"}
# Python function calls (and C calls) of one repeated 8-byte all_reduce at 2 ranks, counted with
# sys.setprofile by this test on a 2-core VM: the device path with the kernel launch
# recorded, and the shared-memory path with the torch kernels, its wait for the peer counted as one
# call (its polls depend on when the peer arrives). A ceiling a little above what was measured (23
# and 32 with the flight record's C writer; 22 and 27 before the communicator's lock, one call on
# either path, and the identity words beside the host's flags, two stores and two loads on the
# shm path; 34 and 39 with the twin before those): more means work crept back onto the hot path.
CALLS_CEILING = {"device": 25, "shm": 34}
TWIN_EXTRA_CALLS = 13  # where no C compiler is, the twin's frame walk and struct writes


def _repeats(rank: int, world_size: int) -> list:
    import torch

    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels="torch")
    comm = gpucomm.get_default_communicator()
    t = torch.zeros(6)
    out = []
    for step in range(4):
        t.fill_(rank + step)
        gpucomm.all_reduce(t)  # from the second call on: the kept launch
        out.append(t[0].item())
    learned = len(comm._repeat._launches)
    # The key holds the address, count, dtype and op; the rest is checked, or the full path runs.
    errors = []
    strided = torch.zeros(12)[::2]  # same address as a fresh 12-element buffer's, 6 elements, not contiguous
    for bad in (strided, "not a tensor"):
        try:
            gpucomm.all_reduce(bad)
        except (TypeError, ValueError) as err:
            errors.append(type(err).__name__)
    as_int = t.view(torch.int32)  # same address and count, another dtype: its own program
    as_int.fill_(rank + 1)
    gpucomm.all_reduce(as_int)
    out.append(as_int[0].item())
    t.fill_(rank + 1.0)
    gpucomm.all_reduce(t, op=gpucomm.ReduceOp.MAX)  # another op
    out.append(t[0].item())
    gpucomm.destroy_process_group()
    return [out, learned, errors]


def test_repeated_calls_reuse_their_launch_and_keep_every_check():
    for out, learned, errors in run_ranks(_repeats, 2):
        assert out == [1.0, 3.0, 5.0, 7.0, 3, 2.0]
        assert learned == 1
        assert errors == ["ValueError", "TypeError"]


def _calls_per_repeat(rank: int, world_size: int, path: str) -> int:
    import sys

    import torch

    import gpucomm

    if path == "device":
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = lambda *args, **kwargs: None  # the launch, recorded as nothing
        gpucomm.init_process_group(transport="shm", kernels="triton")
    else:
        gpucomm.init_process_group(transport="shm", kernels="torch")
    t = torch.ones(2)
    count = 0
    waiting = None  # the frame of a host wait for the peer: its polls depend on the peer's timing

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        nonlocal count, waiting
        if waiting is not None:
            if event == "return" and frame is waiting:
                waiting = None
            return
        if event == "call" and frame.f_code.co_name == "_poll":
            waiting = frame
        count += event in ("call", "c_call")

    for step in range(4):  # the same line every time: the flight record knows the call site by then
        if step == 3:
            sys.setprofile(profile)
        gpucomm.all_reduce(t)
    sys.setprofile(None)
    gpucomm.destroy_process_group()
    return count


@pytest.mark.parametrize("path", ["device", "shm"])
def test_python_calls_per_repeated_call_stay_under_the_ceiling(path):
    env = INTERPRET if path == "device" else None
    counts = run_ranks(_calls_per_repeat, 2, path, env=env)
    ceiling = CALLS_CEILING[path] + (TWIN_EXTRA_CALLS if native.load("flight_record") is None else 0)
    assert counts[0] <= ceiling, f"{counts[0]} Python calls per repeated all_reduce on the {path} path"
