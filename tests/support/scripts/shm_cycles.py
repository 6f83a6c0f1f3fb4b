"""Init/destroy cycles in a /dev/shm that holds one job: run by tests/comm/test_destroy_releases.py
inside a private mount namespace (``unshare -m``) whose /dev/shm is a small tmpfs.

    python shm_cycles.py TRANSPORT CYCLES WORLD_SIZE

Each rank runs CYCLES times: init (GPUCOMM_TRANSPORT=TRANSPORT), blocking and asynchronous
collectives (a kept launch, an asynchronous Work the rank holds on to), destroy; the cyclic
garbage collector is off, so that only what destroy gives back is free for the next init.
Prints one JSON line: per rank and cycle, the path that served CPU tensors, the warnings, the
gpucomm mappings left in the rank right after destroy and the bytes used in /dev/shm then.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spawn import run_ranks  # noqa: E402  (tests/ on the path first)

TIMEOUT_S = 60.0


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _mapped() -> int:
    """This process's mappings of gpucomm segments."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if "/dev/shm/gpucomm_" in line)


def _used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def _cycles(rank: int, world_size: int, transport: str, cycles: int) -> list[dict]:
    import torch

    import gpucomm

    gc.disable()  # destroy must give the memory back by itself, not the cyclic collector
    lines = _Lines()
    logging.getLogger("gpucomm").addHandler(lines)
    report = []
    held = []  # Works the caller keeps past destroy
    for _ in range(cycles):
        gpucomm.init_process_group(timeout=TIMEOUT_S, transport=transport)
        path = gpucomm.get_default_communicator().paths()["cpu"]
        t = torch.full((4099,), float(rank + 1))
        for _ in range(2):  # the second is a kept launch (gpucomm.workspace.repeat)
            gpucomm.all_reduce(t)
        held.append(gpucomm.all_reduce(t, async_op=True))
        held[-1].wait()
        gpucomm.broadcast(t, src=0)
        right = bool((t == 4.0 * world_size * (world_size + 1) // 2).all())
        gpucomm.barrier()
        gpucomm.destroy_process_group()
        report.append({"path": path, "right": right, "mapped": _mapped(), "used": _used(), "warnings": lines.lines})
        lines.lines = []
    return report


def main(argv: list[str]) -> None:
    transport, cycles, world_size = argv[1], int(argv[2]), int(argv[3])
    results = run_ranks(_cycles, world_size, transport, cycles, timeout=4 * TIMEOUT_S)
    left = sorted(name for name in os.listdir("/dev/shm") if name.startswith("gpucomm"))
    print(json.dumps({"results": results, "left": left}))


if __name__ == "__main__":
    main(sys.argv)
