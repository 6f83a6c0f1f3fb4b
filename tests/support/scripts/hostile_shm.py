"""Ranks on a hostile /dev/shm: run by tests/transport/test_hostile_hosts.py inside a private mount
namespace (``unshare -m``) whose /dev/shm is a small tmpfs, or with one rank in a /dev/shm of
its own.

    python hostile_shm.py spawn CASES WORLD_SIZE   # WORLD_SIZE ranks through tests/support/spawn.py
    python hostile_shm.py rank CASES               # this process is RANK of WORLD_SIZE (env://)

CASES, comma-separated, run one after the other: ``auto`` (the default path: gloo must serve every
CPU collective, right, after one warning line), ``shm`` (GPUCOMM_TRANSPORT=shm: init must raise
WorkspaceUnavailableError) or ``heap`` (room for the workspaces only: gpucomm.empty must raise it,
all_reduce go on working).
Prints one JSON line: what each rank returned, per case, and the gpucomm entries left in this
/dev/shm at the end.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spawn import run_ranks  # noqa: E402  (tests/ on the path first)

TIMEOUT_S = 60.0  # the open must end long before this: the ranks agree, nobody waits it out


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _auto(rank: int, world_size: int) -> dict:
    import torch

    import gpucomm

    lines = _Lines()
    logging.getLogger("gpucomm").addHandler(lines)
    gpucomm.init_process_group(timeout=TIMEOUT_S)
    path = gpucomm.get_default_communicator().paths()["cpu"]
    wrong = []
    x = torch.arange(5, dtype=torch.float32) + rank
    t = x.clone()
    gpucomm.all_reduce(t)
    if t.tolist() != [float(world_size * i + world_size * (world_size - 1) // 2) for i in range(5)]:
        wrong.append(f"all_reduce {t.tolist()}")
    # 4 MiB: on a workspace mapped without its pages reserved, this touches more pages than a
    # 4 MiB /dev/shm holds (SIGBUS); on gloo it is one more right answer.
    big = torch.full((1 << 20,), float(rank + 1))
    gpucomm.all_reduce(big)
    if not bool((big == world_size * (world_size + 1) // 2).all()):
        wrong.append("all_reduce of 4 MiB")
    t = x.clone()
    gpucomm.broadcast(t, src=world_size - 1)
    if t.tolist() != [float(i + world_size - 1) for i in range(5)]:
        wrong.append(f"broadcast {t.tolist()}")
    parts = [torch.empty(5) for _ in range(world_size)]
    gpucomm.all_gather(parts, x)
    if [p.tolist() for p in parts] != [[float(i + r) for i in range(5)] for r in range(world_size)]:
        wrong.append(f"all_gather {[p.tolist() for p in parts]}")
    out = torch.empty(2)
    gpucomm.reduce_scatter_tensor(out, torch.arange(2 * world_size, dtype=torch.float32) * (rank + 1))
    total = world_size * (world_size + 1) // 2
    if out.tolist() != [float((2 * rank + i) * total) for i in range(2)]:
        wrong.append(f"reduce_scatter_tensor {out.tolist()}")
    gpucomm.barrier()
    gpucomm.destroy_process_group()
    return {"path": path, "wrong": wrong, "warnings": lines.lines}


def _shm(rank: int, world_size: int) -> dict:
    import gpucomm

    start = time.monotonic()
    try:
        gpucomm.init_process_group(timeout=TIMEOUT_S, transport="shm")
    except gpucomm.GpucommError as err:
        return {"error": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}
    gpucomm.destroy_process_group()
    return {"error": None, "message": "", "seconds": time.monotonic() - start}


def _heap(rank: int, world_size: int) -> dict:
    """A /dev/shm with room for the workspaces but not for the symmetric heap: every empty()
    (the first, and a second that tries again) raises on every rank; collectives go on."""
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=TIMEOUT_S, transport="shm")
    path = gpucomm.get_default_communicator().paths()["cpu"]
    tries, wrong = [], []
    for _ in range(2):
        start = time.monotonic()
        try:
            gpucomm.empty(4)
            tries.append({"error": None, "message": "", "seconds": time.monotonic() - start})
        except gpucomm.GpucommError as err:
            tries.append({"error": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start})
        t = torch.arange(5, dtype=torch.float32) + rank
        gpucomm.all_reduce(t)
        if t.tolist() != [float(world_size * i + world_size * (world_size - 1) // 2) for i in range(5)]:
            wrong.append(f"all_reduce {t.tolist()}")
    gpucomm.destroy_process_group()
    return {"path": path, "wrong": wrong, "tries": tries}


CASES = {"auto": _auto, "shm": _shm, "heap": _heap}


def _left() -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith("gpucomm"))


def main(argv: list[str]) -> None:
    mode, cases = argv[1], argv[2].split(",")
    results = {}
    for case in cases:
        if mode == "spawn":
            results[case] = run_ranks(CASES[case], int(argv[3]), timeout=2 * TIMEOUT_S)
        else:
            results[case] = [CASES[case](int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))]
    print(json.dumps({"results": results, "left": _left()}))


if __name__ == "__main__":
    main(sys.argv)
