"""all_reduce of a symmetric tensor (gpucomm.empty) against an ordinary one, side by side.

On the shared-memory path of this host (the torch kernels by default; ``--device cuda`` for a
lent GPU, where ``--multimem`` adds the NVLink SHARP path), four series per size, measured in
alternating order round after round:

- ``ordinary``: a torch tensor, the table's algorithm (copied into the workspace's halves);
- ``symmetric``: a tensor of the symmetric heap, the table's algorithm (two-shot in place above
  one half of the workspace, gpucomm.workspace.engine);
- ``ordinary_2shot`` and ``symmetric_2shot``: two-shot forced (GPUCOMM_ALGO=twoshot), so that the
  symmetric one runs in place at every size: the copy it saves, size by size;
- with ``--multimem``: ``symmetric_multimem`` (GPUCOMM_ALGO=multimem).

Each rank times each call alone (wall clock; on a GPU after a synchronize); a series' figure
in a round is :func:`timing.slowest_rank` of its calls (per call the slowest rank, then the median
over calls), and at a size the median over rounds; a ratio is taken round by round (the series
of a pair ran one after the other) and its median and range over the rounds are given. The op is
AVG, so the values stay where they started (every rank's tensor holds its rank + 1 before the
first call). After a size's timed rounds each series' tensor is refilled with rank + 1 and one
more call is checked on every rank (:func:`timing.check_after`): without the refill, a call that
did nothing would leave the mean the earlier calls wrote, and pass. A wrong series marks the
size's row (``wrong``) and fails the run.

Example::

    OMP_NUM_THREADS=1 python -m gpucomm._bench.symmetric --nproc 4 --json symmetric.json
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time

from .hostinfo import run_settings, write_json
from .ranks import rank_env, spawn_ranks
from .timing import check_after, slowest_rank

__all__ = ["main", "SIZES"]

# 8 B to 64 MiB: a factor of 4 apart up to 32 MiB, then 64 MiB.
SIZES = [8 << (2 * i) for i in range(12)] + [64 << 20]


def _calls(nbytes: int) -> int:
    """Calls timed per round: enough for a median below 64 KiB, few where one call takes long."""
    return 40 if nbytes <= 64 << 10 else 10 if nbytes <= 4 << 20 else 3


def _rank(
    rank: int,
    world: int,
    port: int,
    device: str,
    kernels: str,
    sizes: list[int],
    rounds: int,
    multimem: bool,
    heap_bytes: int,
    results: multiprocessing.Queue,
) -> None:
    rank_env(rank, world, port)
    import warnings

    import torch

    import gpucomm

    transport = "shm" if device == "cpu" else "cuda_ipc"
    gpucomm.init_process_group(transport=transport, kernels=kernels, heap_bytes=heap_bytes, timeout=600)
    world_comm = gpucomm.get_default_communicator()
    comms = {"ordinary": world_comm, "symmetric": world_comm}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # forcing multimem warns that float SUM leaves the contract
        forced = world_comm.new_subgroup(list(range(world)), algo="twoshot", heap_bytes=heap_bytes)
        comms["ordinary_2shot"] = comms["symmetric_2shot"] = forced
        if multimem:
            mm = world_comm.new_subgroup(list(range(world)), algo="multimem", heap_bytes=heap_bytes)
            mm.heap(device)  # opens the heap (collective), and with it the multicast object
            why = mm._engines[device].multimem.reason  # the one-line reason the engine logs then
            if why:
                mm.close()
            else:
                comms["symmetric_multimem"] = mm
    on_gpu = device != "cpu"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    AVG = gpucomm.ReduceOp.AVG
    expected = (world + 1) / 2
    dev = torch.device(device, torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    # out[series][size][round]: the seconds of each timed call of that round.
    out: dict[str, dict[int, list[list[float]]]] = {name: {} for name in comms}
    wrong: dict[int, list[str]] = {}
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        tensors = {}
        for name, comm in comms.items():
            t = (
                comm.empty(n, dtype=torch.float32, device=device)
                if name.startswith("symmetric")
                else torch.empty(n, device=device)
            )
            t.fill_(rank + 1)
            tensors[name] = t
        calls = _calls(nbytes)
        for name in comms:  # warm-up: builds every program
            comms[name].all_reduce(tensors[name], AVG)
        sync()
        for r in range(rounds):
            order = list(comms) if r % 2 == 0 else list(reversed(comms))
            for name in order:
                comm, t = comms[name], tensors[name]
                comm.barrier()
                times = []
                for _ in range(calls):
                    start = time.perf_counter()
                    comm.all_reduce(t, AVG)
                    sync()
                    times.append(time.perf_counter() - start)
                out[name].setdefault(nbytes, []).append(times)
        for name, t in tensors.items():
            check_after(lambda t=t: t.fill_(rank + 1), lambda name=name, t=t: comms[name].all_reduce(t, AVG), dev)
            if not torch.all(t == expected):
                wrong.setdefault(nbytes, []).append(f"{name}: {t.flatten()[:4].tolist()}, expected {expected}")
        del tensors
    for comm in {id(c): c for c in comms.values() if c is not world_comm}.values():
        comm.close()
    gpucomm.destroy_process_group()
    results.put(
        (
            rank,
            {
                "rounds": {k: {str(s): v for s, v in d.items()} for k, d in out.items()},
                "wrong": {str(s): v for s, v in wrong.items()},
                "no_multimem": why if multimem else None,
            },
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--kernels", default="torch", help="torch (the CPU's default), triton or cuda")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--multimem", action="store_true", help="add the multimem series (a GPU with NVLink SHARP)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    sizes = [s for s in SIZES if s <= args.max_bytes]
    heap_bytes = 2 * max(sizes) + (16 << 20)  # the tensors of one size, with room for the reserve
    per_rank = spawn_ranks(
        _rank,
        args.nproc,
        args.device,
        args.kernels,
        sizes,
        args.rounds,
        args.multimem,
        heap_bytes,
        timeout=3600,
    )
    wrong = [
        f"rank {r} at {nbytes} bytes: {w}"
        for r in sorted(per_rank)
        for nbytes, ws in per_rank[r]["wrong"].items()
        for w in ws
    ]
    no_multimem = per_rank[0]["no_multimem"]
    if no_multimem:
        print(f"multimem: not run here: {no_multimem}")
    series = list(per_rank[0]["rounds"])
    rows = []
    for nbytes in sizes:
        # Which series' checked call was wrong at this size, on any rank: the row is wrong.
        row: dict = {
            "bytes": nbytes,
            "wrong": sorted({w.split(":")[0] for r in per_rank for w in per_rank[r]["wrong"].get(str(nbytes), [])}),
        }
        # A round's figure of a series: per call the slowest rank, then the median over calls.
        per_round = {
            name: [
                slowest_rank([per_rank[r]["rounds"][name][str(nbytes)][i] for r in sorted(per_rank)])
                for i in range(args.rounds)
            ]
            for name in series
        }
        for name in series:
            row[name] = round(statistics.median(per_round[name]) * 1e6, 1)
        # Ratios round by round (the two series of a pair ran next to each other), then their median
        # and spread: what the machine's other load does to both cancels within a round.
        for a, b in (("symmetric", "ordinary"), ("symmetric_2shot", "ordinary_2shot")):
            ratios = sorted(x / y for x, y in zip(per_round[a], per_round[b]))
            row[f"{a}/{b}"] = round(statistics.median(ratios), 3)
            row[f"{a}/{b} range"] = [round(ratios[0], 3), round(ratios[-1], 3)]
        rows.append(row)
    print(
        f"{'bytes':>10} " + " ".join(f"{s:>18}" for s in series) + "      sym/ord (range)      sym2/ord2 (range)"
        "   (us per call: per call the slowest rank, median over calls and rounds)"
    )
    for row in rows:
        cells = " ".join(f"{row[s]:18.1f}" for s in series)
        a, b = "symmetric/ordinary", "symmetric_2shot/ordinary_2shot"
        print(
            f"{row['bytes']:>10} {cells}  {row[a]:6.3f} ({row[a + ' range'][0]:.2f}-{row[a + ' range'][1]:.2f})"
            f"  {row[b]:6.3f} ({row[b + ' range'][0]:.2f}-{row[b + ' range'][1]:.2f})"
            + (f"  WRONG: {', '.join(row['wrong'])}" if row["wrong"] else "")
        )
    print("results: " + ("all correct" if not wrong else "WRONG: " + "; ".join(wrong[:5])))
    if args.json:
        write_json(args.json, run_settings(args), rows=rows, wrong=wrong, no_multimem=no_multimem)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
