"""``gpucomm-demo``: spawn local ranks, run every collective on each path this host has, check
each result against a float64 reference, and print a table.

    gpucomm-demo --nproc 4            # CPU: gpucomm's gloo path, the shm workspace path with torch
                                      # kernels, and the Triton program kernel under the interpreter
    gpucomm-demo --nproc 2 --size 1M  # on a GPU host: the CUDA workspace path on the Triton kernels

Without a GPU the Triton rows run gpucomm's GPU kernel (one launch of the program kernel per
collective, waiting for its peers inside the kernel) under Triton's interpreter, on the
shared-memory workspace, across the same processes: each collective once, marked
``interpreted`` (their time is the interpreter's, not a GPU's). TRITON_INTERPRET=1 is set in
each rank's process before anything imports triton; the gloo and torch-kernel rows do not use it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch

__all__ = ["main"]


# What each row's check compares the collective's output with (float32 inputs of small
# integers, so every expected value is exact and the comparison is torch.equal).
REFERENCES = {
    "all_reduce": "sum of every rank's input",
    "reduce": "sum of every rank's input, on rank 0",
    "broadcast": "rank 0's input",
    "all_gather": "inputs of all ranks, in rank order",
    "gather": "inputs of all ranks, on rank 0",
    "scatter": "rank 0's piece for this rank",
    "reduce_scatter": "this rank's slice of the sum",
    "all_to_all": "piece for this rank from every rank",
    "send/recv": "previous rank's input (ring)",
    "barrier": "returns on every rank",
}


def _paths(gpu: bool) -> list[tuple[str, dict[str, str], str, bool]]:
    """(label, knobs, tensor device, interpreted) for every path this host can run.

    "gloo" is gpucomm's own gloo path (gpucomm's Communicator over a gloo group), not
    torch.distributed's gloo backend.
    """
    paths = [
        ("gloo", {"transport": "gloo"}, "cpu", False),
        ("shm+torch", {"transport": "shm", "kernels": "torch"}, "cpu", False),
    ]
    if gpu:
        paths.append(("cuda+triton", {"transport": "cuda_ipc", "kernels": "triton"}, "cuda", False))
    else:
        paths.append(("shm+triton", {"transport": "shm", "kernels": "triton"}, "cpu", True))
    return paths


def _cases(rank: int, P: int, n: int, device: str) -> list[tuple[str, Callable[[], None], Callable[[], bool]]]:
    """(name, call, check) for every collective; inputs are small integers so sums are exact."""
    import gpucomm as dist

    def vec(r: int, k: int = n) -> torch.Tensor:
        return (torch.arange(k, dtype=torch.float32) % 7 + r).to(device)

    cases: list[tuple[str, Callable[[], None], Callable[[], bool]]] = []
    t = vec(rank)
    total = sum(vec(r) for r in range(P))
    cases.append(("all_reduce", lambda: (t.copy_(vec(rank)), dist.all_reduce(t)), lambda: torch.equal(t, total)))
    r_t = vec(rank)
    cases.append(
        (
            "reduce",
            lambda: (r_t.copy_(vec(rank)), dist.reduce(r_t, dst=0)),
            lambda: rank != 0 or torch.equal(r_t, total),
        )
    )
    b = vec(rank)
    cases.append(("broadcast", lambda: (b.copy_(vec(rank)), dist.broadcast(b, src=0)), lambda: torch.equal(b, vec(0))))
    gathered = torch.empty(n * P, device=device)
    cases.append(
        (
            "all_gather",
            lambda: dist.all_gather_into_tensor(gathered, vec(rank)),
            lambda: torch.equal(gathered, torch.cat([vec(r) for r in range(P)])),
        )
    )
    g_list = [torch.empty(n, device=device) for _ in range(P)] if rank == 0 else None
    cases.append(
        (
            "gather",
            lambda: dist.gather(vec(rank), g_list, dst=0),
            lambda: g_list is None or torch.equal(torch.cat(g_list), torch.cat([vec(r) for r in range(P)])),
        )
    )
    sc = torch.empty(n, device=device)
    cases.append(
        (
            "scatter",
            lambda: dist.scatter(sc, [vec(r) for r in range(P)] if rank == 0 else None, src=0),
            lambda: torch.equal(sc, vec(rank)),
        )
    )
    rs = torch.empty(n, device=device)
    full = torch.cat([vec(rank) * (c + 1) for c in range(P)])
    cases.append(
        ("reduce_scatter", lambda: dist.reduce_scatter_tensor(rs, full), lambda: torch.equal(rs, total * (rank + 1)))
    )
    a2a = torch.empty(n * P, device=device)
    send = torch.cat([vec(rank) + 100 * c for c in range(P)])
    cases.append(
        (
            "all_to_all",
            lambda: dist.all_to_all_single(a2a, send),
            lambda: torch.equal(a2a, torch.cat([vec(r) + 100 * rank for r in range(P)])),
        )
    )
    if P > 1:
        got = torch.empty(n, device=device)

        def ring() -> None:
            req = dist.isend(vec(rank), dst=(rank + 1) % P)
            dist.recv(got, src=(rank - 1) % P)
            req.wait()

        cases.append(("send/recv", ring, lambda: torch.equal(got, vec((rank - 1) % P))))
    cases.append(("barrier", lambda: dist.barrier(), lambda: True))
    return cases


def _rank_main(rank: int, P: int, port: int, n: int, iters: int, gpu: bool, queue: multiprocessing.Queue) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(P),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(P),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if not gpu:
        # Before anything imports triton (nothing has yet in this fresh process): the Triton rows
        # run under the interpreter; the other rows name the torch kernels or gloo.
        os.environ["TRITON_INTERPRET"] = "1"
    import gpucomm

    rows = []
    try:
        for label, knobs, device, interpreted in _paths(gpu):
            gpucomm.init_process_group(timeout=120, **knobs)
            for name, call, check in _cases(rank, P, n, device):
                start = time.perf_counter()
                call()
                first = time.perf_counter() - start
                ok = check()
                times = [first]
                for _ in range(0 if interpreted else iters):  # interpreted: each collective once
                    if device == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    call()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                if len(times) > 1:
                    times = times[1:]  # the first call builds the program; time the repeats
                rows.append((label, name, ok and check(), statistics.median(times) * 1e6, interpreted))
            gpucomm.destroy_process_group()
        queue.put((rank, rows, None))
    except Exception as err:  # noqa: BLE001 - sent to the parent, which prints it and fails
        import traceback

        queue.put((rank, rows, traceback.format_exc()))
        raise SystemExit(1) from err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gpucomm-demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=4, help="local ranks to spawn (default 4)")
    parser.add_argument("--size", default="4099", help="elements per rank (default 4099, an odd size)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per collective (median reported)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before the whole run is stopped")
    args = parser.parse_args(argv)
    n = int(args.size[:-1]) * {"K": 1024, "M": 1 << 20}[args.size[-1]] if args.size[-1] in "KM" else int(args.size)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    gpu = torch.cuda.is_available()
    procs = [
        ctx.Process(target=_rank_main, args=(r, args.nproc, port, n, args.iters, gpu, queue)) for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[list, str | None]] = {}
    deadline = time.monotonic() + args.timeout
    while len(results) < args.nproc and time.monotonic() < deadline:
        try:
            rank, rows, error = queue.get(timeout=1)
            results[rank] = (rows, error)
        except Exception:  # noqa: BLE001 - queue.Empty: keep waiting until the deadline
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    errors = {r: e for r, (_, e) in results.items() if e}
    missing = sorted(set(range(args.nproc)) - set(results))
    rows0 = results.get(0, ([], None))[0]
    print(
        f"gpucomm-demo: {args.nproc} ranks, {n} float32 elements per rank, torch {torch.__version__}, "
        f"{'CUDA ' + torch.cuda.get_device_name() if gpu else 'no GPU: CPU paths, GPU kernels under the interpreter'}"
    )
    print("each row: one gpucomm collective on float32 inputs, checked on every rank with torch.equal against the")
    print(
        "reference named; path 'gloo' is gpucomm's gloo path, "
        "'shm+torch' its shared-memory workspace with torch kernels,"
    )
    if gpu:
        print("'cuda+triton' its CUDA IPC workspace with the Triton program kernel")
    else:
        print(
            "'shm+triton' the Triton program kernel (gpucomm's GPU kernel) "
            "on the shared-memory workspace under Triton's"
        )
        print("interpreter (TRITON_INTERPRET=1): each collective once, its time the interpreter's, not a GPU's")
    print(f"{'path':<12} {'collective':<16} {'dtype':<8} {'time (us)':>12}  {'check':<6} reference")
    all_ok = True
    for i, (label, name, _, micros, interpreted) in enumerate(rows0):
        ok = all(i < len(results[r][0]) and results[r][0][i][2] for r in results)
        all_ok &= ok
        mark = " (interpreted)" if interpreted else ""
        dtype = "-" if name == "barrier" else "float32"
        check = "OK" if ok else "WRONG"
        print(f"{label:<12} {name:<16} {dtype:<8} {micros:>12.1f}  {check:<6} {REFERENCES[name]}{mark}")
    for r, e in sorted(errors.items()):
        print(f"rank {r} failed:\n{e}", file=sys.stderr)
    if missing:
        print(f"rank(s) {missing} did not report within {args.timeout:g} s", file=sys.stderr)
    ok = all_ok and not errors and not missing and bool(rows0)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
