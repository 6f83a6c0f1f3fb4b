"""The one spawn harness: run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes.

Every rank is a fresh process (no inherited CUDA or Triton state, nothing of the test's own
modules) with the parent's environment as it is at the call, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (a free port) set, plus ``env``. Each rank sends
back its return value or its traceback through its own pipe; the parent waits with a hard
deadline, SIGKILLs whatever is still alive, and raises :class:`RanksFailed` naming every rank that
failed or hung.

Ranks are forked from a ``forkserver`` that has imported torch and nothing else: a rank of the
``spawn`` start method spends about 1.3 s of CPU importing torch on the 2-core CI machine, once
per rank of every test (three test files that start 45 ranks between them took 73 s with spawned
ranks and 50 s with forked ones, side by side). torch's import reads a few variables (OpenMP's thread count among
them, :data:`_READ_BY_TORCH_IMPORT`); where the environment a rank is to have differs from the
server's in any of those, that call's ranks are spawned instead.

This module imports only the standard library: it is imported in every child before ``env`` is
applied, and variables such as TRITON_INTERPRET must be set before triton is first imported.

Example::

    from spawn import run_ranks

    def _square(rank, world_size, base):
        return base + rank * rank

    assert run_ranks(_square, 3, 10) == [10, 11, 14]
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["run_ranks", "free_port", "RanksFailed"]

# After the first rank fails its peers usually block on it (a store wait, a flag); give them
# this long to report their own error, then kill them instead of waiting for the full timeout.
FAIL_GRACE_S = 5.0

# Prefixes of the variables that torch's import (or a library it loads: libgomp reads
# OMP_NUM_THREADS once, when it is loaded) reads; a forkserver's children keep what it read.
_READ_BY_TORCH_IMPORT = ("OMP_", "GOMP_", "KMP_", "MKL_", "TORCH", "PYTORCH_", "CUDA_", "LD_", "PYTHON")
_server_env: dict[str, str] | None = None  # those variables as the forkserver started with them


def _read_by_torch_import(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_READ_BY_TORCH_IMPORT)}


def _context(env: Mapping[str, str]) -> multiprocessing.context.BaseContext:
    """The forkserver (started on first use, with torch imported) unless ``env`` differs from its
    environment in a variable torch's import reads; then spawn."""
    global _server_env
    wanted = _read_by_torch_import(env)
    if _server_env is None:
        _server_env = _read_by_torch_import(os.environ)
        multiprocessing.set_forkserver_preload(["torch"])
    if wanted != _server_env:
        return multiprocessing.get_context("spawn")
    return multiprocessing.get_context("forkserver")


class RanksFailed(RuntimeError):
    """Some ranks raised, died or hung; ``failures`` maps rank -> traceback or reason."""

    def __init__(self, failures: Mapping[int, str], hung: Iterable[int], timeout: float) -> None:
        self.failures = dict(sorted(failures.items()))
        self.hung = sorted(hung)
        parts = []
        if self.hung:
            parts.append(
                f"rank(s) {self.hung} did not finish within the {timeout:g} s timeout (or {FAIL_GRACE_S:g} s "
                "after another rank failed) and were killed"
            )
        for rank, text in self.failures.items():
            parts.append(f"rank {rank} failed:\n{text}")
        super().__init__("\n".join(parts))


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank: int, env: dict[str, str], payload: bytes, conn: multiprocessing.connection.Connection) -> None:
    # env first: unpickling fn imports its module (and triton) only after this line. The whole
    # environment: a forkserver's child starts with the server's, not the caller's of now.
    os.environ.clear()
    os.environ.update(env)
    try:
        fn, world_size, args = pickle.loads(payload)
        message = ("ok", pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:  # every failure, SystemExit included, goes back to the parent
        message = ("err", traceback.format_exc())
    conn.send_bytes(pickle.dumps(message))
    conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
    allow_exit: Iterable[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ranks ``0..world_size-1``; return their results.

    Args:
        fn: a module-level function (it is pickled by reference).
        world_size: number of processes.
        *args: picklable arguments passed to every rank after ``(rank, world_size)``.
        timeout: hard limit in seconds for the whole run; ranks alive after it are SIGKILLed.
        env: extra environment variables set in every rank before ``fn``'s module is imported.
        allow_exit: ranks that may die without returning (their result is ``None``).

    Raises:
        RanksFailed: a rank raised, died unexpectedly or was still running at the deadline.
    """
    __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not this function's source
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"run_ranks: world_size must be an int >= 1, got {world_size!r}")
    allowed = set(allow_exit)
    if not allowed <= set(range(world_size)):
        raise ValueError(f"run_ranks: allow_exit {sorted(allowed)} names ranks outside 0..{world_size - 1}")
    payload = pickle.dumps((fn, world_size, args))
    port = free_port()
    base = {**os.environ, **(env or {})}
    ctx = _context(base)
    procs, readers = [], []
    for rank in range(world_size):
        rank_env = {
            **base,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **(env or {}),  # env may name the rank variables too
        }
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(rank, rank_env, payload, writer), name=f"rank{rank}", daemon=True)
        proc.start()
        writer.close()  # the child holds its own copy; ours would only leak
        procs.append(proc)
        readers.append(reader)

    results: list[Any] = [None] * world_size
    failures: dict[int, str] = {}
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    try:
        while pending:
            now = time.monotonic()
            if now >= deadline:
                break
            waitables = [readers[r] for r in pending] + [procs[r].sentinel for r in pending]
            ready = multiprocessing.connection.wait(waitables, timeout=deadline - now)
            for rank in sorted(pending):
                reader, proc = readers[rank], procs[rank]
                if reader in ready or proc.sentinel in ready:
                    if _collect(rank, reader, proc, results, failures, allowed):
                        pending.discard(rank)
            if failures:
                deadline = min(deadline, time.monotonic() + FAIL_GRACE_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join()
        for reader in readers:
            reader.close()
    if failures or pending:
        raise RanksFailed(failures, pending, timeout)
    return results


def _collect(rank, reader, proc, results, failures, allowed) -> bool:
    """Read rank's message if one arrived, or note its death; True once the rank is done."""
    if reader.poll():
        try:
            status, body = pickle.loads(reader.recv_bytes())
        except EOFError:
            status, body = None, None
        if status == "ok":
            try:
                results[rank] = pickle.loads(body)
            except Exception:  # e.g. a class the parent cannot import: report it, do not crash
                failures[rank] = f"result could not be unpickled in the parent:\n{traceback.format_exc()}"
            return True
        if status == "err":
            failures[rank] = body
            return True
    if proc.is_alive():
        return False
    proc.join()
    if rank not in allowed:
        failures[rank] = f"process exited with code {proc.exitcode} without returning a result"
    return True
