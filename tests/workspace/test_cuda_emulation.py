"""GPUCOMM_CUDA_EMULATE=1 GPUCOMM_KERNELS=cuda across real processes: the CUDA C++ program kernel's
waits and error records, as a GPU run has them.

- a late peer: the others wait for it inside the kernel, and every result is right;
- a rank calling another collective: every rank raises CommMismatchError (the peer's flag at this
  epoch carries another fingerprint), from the kernel's error record;
- an absent rank: the others raise CommTimeoutError naming it, within the timeout (the kernel's
  deadline on the host clock), and the next call fails at once (the poison);
- GPUCOMM_DEBUG=INFO says ``kernels=cuda (emulated)``; without the switch, kernels=cuda on a host
  without a GPU stays the clear error it was.
"""

from __future__ import annotations

import time

from spawn import run_ranks

EMULATE = {"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64"}
KNOBS = {"transport": "shm", "kernels": "cuda", "workspace_bytes": "64K", "channels": 2}


def _late_mismatch_absent(rank: int, world_size: int, timeout: float) -> dict[str, object]:
    import dataclasses

    import torch

    import gpucomm
    from gpucomm.comm.communicator import Communicator

    gpucomm.init_process_group(**KNOBS, timeout=60)
    world = gpucomm.get_default_communicator()
    seen: dict[str, object] = {}

    def comm(name: str, seconds: float = 60.0) -> Communicator:
        config = dataclasses.replace(world.config, timeout=seconds)
        return Communicator(world.store, rank, world_size, prefix=f"{world.prefix}{name}/", config=config)

    with comm("late") as c:
        ok = []
        for k in range(3):
            if rank == k % world_size:
                time.sleep(0.5)  # this rank comes late: the others wait inside the kernel
            t = torch.full((3001,), float(rank + k))
            c.all_reduce(t)
            ok.append(torch.equal(t, torch.full((3001,), float(sum(range(world_size)) + world_size * k))))
        seen["late"] = ok
    with comm("mismatch") as c:
        c.all_reduce(torch.ones(5))
        try:
            if rank == 1:
                c.broadcast(torch.ones(5), src=0)
            else:
                c.all_reduce(torch.ones(5))
            seen["mismatch"] = "returned"
        except gpucomm.CommMismatchError as err:
            seen["mismatch"] = f"mismatch {err.peers}"
    with comm("absent", timeout) as c:
        c.all_reduce(torch.ones(5))
        if rank == 1:
            world.store.wait([f"{world.prefix}absent_done"])  # never calls
        else:
            start = time.monotonic()
            try:
                c.all_reduce(torch.ones(5))
                seen["absent"] = "returned"
            except gpucomm.CommTimeoutError as err:
                seen["absent"] = (err.missing, time.monotonic() - start)
            try:
                c.all_reduce(torch.ones(5))
            except gpucomm.GpucommError as err:
                seen["after"] = type(err).__name__
            world.store.set(f"{world.prefix}absent_done", b"1")
    gpucomm.destroy_process_group()
    return seen


def test_late_peer_mismatch_and_timeout_records() -> None:
    timeout = 2.0
    results = run_ranks(_late_mismatch_absent, 3, timeout, env=EMULATE, timeout=300)
    for rank, seen in enumerate(results):
        assert seen["late"] == [True, True, True], f"rank {rank}: {seen}"
        assert str(seen["mismatch"]).startswith("mismatch"), f"rank {rank}: {seen}"
    assert results[0]["mismatch"] == "mismatch [1]", results[0]
    for rank in (0, 2):
        missing, elapsed = results[rank]["absent"]
        assert missing == [1], results[rank]
        assert timeout * 0.9 <= elapsed <= timeout + 10, f"rank {rank} raised after {elapsed:.1f} s"
        assert results[rank]["after"] == "CommBrokenError", results[rank]


def _debug_line(rank: int, world_size: int) -> list[str]:
    import io
    import logging

    import torch

    import gpucomm

    stream = io.StringIO()
    gpucomm.init_process_group(**KNOBS, timeout=60, debug="INFO")
    handler = logging.StreamHandler(stream)
    logging.getLogger("gpucomm").addHandler(handler)
    gpucomm.all_reduce(torch.ones(7))
    gpucomm.destroy_process_group()
    return [line for line in stream.getvalue().splitlines() if "all_reduce" in line]


def test_the_log_says_emulated() -> None:
    for lines in run_ranks(_debug_line, 2, env=EMULATE, timeout=120):
        assert lines and all(line.endswith("kernels=cuda (emulated)") for line in lines), lines


def _without_switch(rank: int, world_size: int) -> str:
    import gpucomm

    try:
        gpucomm.init_process_group(**KNOBS, timeout=20)
    except gpucomm.UnsupportedError as err:
        return str(err)
    gpucomm.destroy_process_group()
    return "initialised"


def test_kernels_cuda_without_the_switch_is_a_clear_error() -> None:
    for text in run_ranks(_without_switch, 2, timeout=120):
        assert "needs a CUDA device" in text and "GPUCOMM_CUDA_EMULATE=1" in text, text
