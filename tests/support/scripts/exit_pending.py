"""A rank that exits with an asynchronous gloo collective still waiting for its peer: run by
tests/distributed/test_exit_pending.py.

    python exit_pending.py JOBS PARALLEL

Imports torch and gpucomm once, then forks two processes per job (ranks 0 and 1, a port of their
own), PARALLEL jobs at a time. Both join a gloo group and run a blocking all_reduce; then rank 0
starts an asynchronous all_reduce that rank 1 never joins and lets the interpreter exit without
destroy_process_group, as a script that ends there does (atexit handlers, then the interpreter's
finalisation; a forked rank never leaves through ``os._exit``). Rank 1 leaves at the moment that
aborted rank 0 before ("terminate called without an active exception"): as rank 0's last atexit
handler has run, so that its pending call fails (the peer's connection closes) while rank 0's
interpreter finalises.
Prints one JSON line: per rank 0, its job, exit status and the end of its stderr.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import socket
import sys
import tempfile

_TELL_PEER: list[int] = []  # rank 0: the pipe to its peer, written as its last atexit handler


def _tell_peer() -> None:
    for fd in _TELL_PEER:
        os.write(fd, b"x")


atexit.register(_tell_peer)  # before torch and gpucomm register theirs: it runs after them (LIFO)

import torch  # noqa: E402

import gpucomm  # noqa: E402

TIMEOUT_S = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, peer_fd: int) -> None:
    gpucomm.init_process_group(transport="gloo", timeout=TIMEOUT_S)
    t = torch.ones(1000)
    gpucomm.all_reduce(t)
    if rank == 0:
        gpucomm.all_reduce(t, async_op=True)  # rank 1 never joins it
        _TELL_PEER.append(peer_fd)
        return  # the script ends: the interpreter exits with the call pending
    select.select([peer_fd], [], [], 2 * TIMEOUT_S)  # rank 0 is at the end of its exit (or gone)
    os._exit(0)  # at once: its connection closes while rank 0 finalises


def _start(rank: int, port: int, peer_fd: int, err_path: str) -> int:
    """Fork ``rank`` of a job; the parent gets its pid, the child never returns."""
    pid = os.fork()
    if pid:
        return pid
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)
    for key, value in {
        "RANK": rank,
        "LOCAL_RANK": rank,
        "WORLD_SIZE": 2,
        "LOCAL_WORLD_SIZE": 2,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }.items():
        os.environ[key] = str(value)
    code = 0
    try:
        _rank(rank, peer_fd)
    except BaseException as exc:  # noqa: BLE001 - reported through the exit status and stderr
        print(f"rank {rank} raised {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 3
    raise SystemExit(code)  # the interpreter's own exit, from the script's top level


def main(argv: list[str]) -> None:
    jobs, parallel = int(argv[1]), int(argv[2])
    results = []
    # No with block: a forked rank's exit runs through this frame and must clean nothing up.
    folder = tempfile.mkdtemp(prefix="gpucomm_exit_")
    for first in range(0, jobs, parallel):
        running = []
        for job in range(first, min(first + parallel, jobs)):
            port = _free_port()
            read_fd, write_fd = os.pipe()
            err = os.path.join(folder, f"{job}.err")
            rank0 = _start(0, port, write_fd, err)
            rank1 = _start(1, port, read_fd, os.devnull)
            os.close(read_fd)
            os.close(write_fd)
            running.append((job, rank0, rank1, err))
        for job, rank0, rank1, err in running:
            _, status = os.waitpid(rank0, 0)
            os.waitpid(rank1, 0)
            with open(err) as f:
                tail = f.read()[-400:]
            results.append({"job": job, "status": os.waitstatus_to_exitcode(status), "stderr": tail})
    shutil.rmtree(folder)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv)
