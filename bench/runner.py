"""One rank of a collective benchmark: every collective × size × round × backend, checked and timed.

Every backend under test is started at once; for each collective and size, every round measures
each backend once, in alternating order (see ``rounds.py``). Every rank measures; rank 0 collects
the other ranks' numbers through the rendezvous store (not through a backend under test, so that
a broken backend cannot corrupt its own report), combines them and prints each collective's
tables once all its sizes are done.
"""

from __future__ import annotations

import datetime
import json
import os
import random
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .backends import (
    DEFAULT_TIMEOUT_S,
    Backend,
    describe_gpucomm,
    gpucomm_api_available,
    make_backend,
    why_unavailable,
)
from .buffers import Buffers
from .collectives import SPECS, Case, Prepared, poison_value
from .combos import DTYPES, combos
from .header import header_text, nccl_info, rank_info, write_report
from .progress import emit, progress_bar, show_bar
from .report import VARIANTS, avg_busbw
from .rounds import combine_rounds, round_order
from .service_threads import release, thread_ids
from .stream import TableStream, combo_label
from .timing import check_after, count_wrong, time_calls, time_graph

__all__ = ["Settings", "run_rank", "DTYPES", "PLANT_ERROR_ENV"]

# Test-only: corrupt one checked element on every checking rank, to prove a wrong result fails
# the run. Not a CLI option, so that nobody reaches for it by accident.
PLANT_ERROR_ENV = "GPUCOMM_BENCH_PLANT_ERROR"


@dataclass
class Settings:
    collectives: list[str]
    sizes: list[int]
    dtype: str
    op: str
    root: int
    iters: int
    warmup: int
    check: bool
    backends: list[str]
    knobs: dict[str, str]  # gpucomm's knobs the user passed; the rest are gpucomm's own (GPUCOMM_*)
    device: str  # auto | cpu | cuda
    timeout_s: float | None  # None: DEFAULT_TIMEOUT_S, and gpucomm's own
    seed: int | None
    json_path: str | None
    plot_path: str | None
    argv: list[str] = field(default_factory=list)
    step_factor: float = 2.0
    max_bytes: int = 0  # as asked (-e); the last row may be smaller
    rounds: int = 1
    bind: str = "auto"  # auto | none | core: where spawned ranks may run (bench/launch.py)
    graph_launches: int = 0  # -G: > 0 times the calls captured into a CUDA graph (timing.time_graph)
    step_bytes: int | None = None  # -i: rows step by this many bytes (not -f's factor)
    threads: int | None = None  # --cpu-threads; None: as many as a rank's cores (bench/threads.py)


def _device(kind: str, local_rank: int) -> torch.device:
    if kind == "cpu" or (kind == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("gpucomm-bench: --device cuda asked for, but torch sees no CUDA device")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


class _Exchange:
    """Per-rank payloads to rank 0 through the store, under a running sequence number."""

    def __init__(self, store: dist.Store, rank: int, world: int) -> None:
        self.store, self.rank, self.world, self.seq = store, rank, world, 0

    def gather(self, payload: object) -> list[object] | None:
        """Every rank's payload on rank 0 (in rank order), None elsewhere."""
        self.seq += 1
        key = f"bench/x/{self.seq}"
        self.store.set(f"{key}/{self.rank}", json.dumps(payload))
        if self.rank != 0:
            return None
        return [json.loads(self.store.get(f"{key}/{r}")) for r in range(self.world)]

    def share(self, value: str | None) -> str:
        """Rank 0's ``value`` on every rank."""
        self.seq += 1
        key = f"bench/s/{self.seq}"
        if self.rank == 0:
            self.store.set(key, value)
        return self.store.get(key).decode()

    def close(self) -> None:
        """Rank 0 hosts the store: it leaves only after every rank has read its last value."""
        key = f"bench/done/{self.seq}"
        if self.rank != 0:
            self.store.set(f"{key}/{self.rank}", "1")
            return
        self.store.wait([f"{key}/{r}" for r in range(1, self.world)])


def _plant_error(result: torch.Tensor) -> None:
    flat = result.view(-1)
    flat[0] = poison_value(result.dtype)


def _measure(prepared: Prepared | None, case: Case, backend, s: Settings) -> dict | None:
    """This rank's per-iteration times and wrong-element count for one variant, None if it has none.

    The check is made after the timed calls (after the graph's replays with -G), on inputs reset
    before it: a collective that goes wrong after its first calls is caught (timing.check_after)."""
    if prepared is None:
        return None
    prepared.reset()
    backend.mod.barrier()
    if s.graph_launches:
        samples = time_graph(prepared.call, case.device, s.warmup, s.iters, s.graph_launches)
    else:
        samples = time_calls(prepared.call, case.device, s.warmup, s.iters)
    wrong = None
    if s.check:
        check_after(prepared.reset, prepared.call, case.device)
        if prepared.result is None:
            wrong = 0
        else:
            if os.environ.get(PLANT_ERROR_ENV) == "1":
                _plant_error(prepared.result)
            wrong = count_wrong(prepared.result, prepared.expected())
    return {"samples": samples, "wrong": wrong}


def _measure_rounds(spec, case: Case, backends: list[Backend], s: Settings, bar) -> dict:
    """This rank's cells at one size, per backend.

    ``{name: {"rounds": [{variant: cell}, ...]}}``, or ``{name: {"error": text}}`` for a backend
    that raised (it sits out the remaining rounds).
    """
    results: dict[str, dict] = {b.name: {"rounds": []} for b in backends}
    # Each backend's calls are prepared once at this size and every round times the same ones, on
    # the rank's buffers (case.buffers): no buffer is allocated between rounds, as in nccl-tests.
    prepared: dict[str, dict[str, Prepared | None]] = {}
    for k in range(s.rounds):
        for backend in round_order(backends, k):
            if "error" in results[backend.name]:
                continue
            try:
                if backend.name not in prepared:
                    op = backend.op(case.op)
                    prepared[backend.name] = {v: spec.prepare(case, backend.mod, op, v == "in_place") for v in VARIANTS}
                cells = {v: _measure(prepared[backend.name][v], case, backend, s) for v in VARIANTS}
            except (RuntimeError, ValueError, TypeError) as err:
                # Reported in the table (and failing the run for the backend under test);
                # a backend refusing e.g. AVG on integers should not hide the others' results.
                results[backend.name] = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
                continue
            results[backend.name]["rounds"].append(cells)
        bar.update(1)
    return results


def _row(spec, case: Case, size: int, per_rank: list[dict], dtype: str) -> dict:
    """Rank 0: one backend's nccl-tests row from every rank's rounds."""
    row = {
        "size": size,
        "count": case.count,
        "type": dtype,
        "redop": case.op if spec.reducing else "none",
        "root": case.root if spec.rooted else -1,
    }
    for variant in VARIANTS:
        cells = [[measured[variant] for measured in p["rounds"]] for p in per_rank]
        row[variant] = combine_rounds(size, spec.factor(case.world), cells)
    return row


def _record(spec, case: Case, size: int, per_rank: list[dict], tables: dict[str, dict], out: TableStream) -> None:
    """Rank 0: each measured backend's row at this size, or its error, into its table and printed."""
    for name in per_rank[0]:
        errors = [f"rank {r}: {p[name]['error']}" for r, p in enumerate(per_rank) if "error" in p[name]]
        if errors:
            tables[name]["error"] = "; ".join(errors)
            out.error(name, tables[name]["error"])
        else:
            tables[name]["rows"].append(_row(spec, case, size, [p[name] for p in per_rank], tables[name]["dtype"]))
            out.row(name, tables[name]["rows"][-1])


def _run_collective(
    coll: str,
    combo: tuple[str, str],
    backends: list[Backend],
    rank,
    world,
    device,
    s: Settings,
    ex: _Exchange,
    bar,
    seed: int,
    not_run: list[dict],
    label: str,
    buffers: Buffers,
) -> list[dict]:
    """Every size of one collective at one (dtype, op) on every started backend; rank 0's tables
    (empty elsewhere), each row printed as it is measured.

    In the order of ``s.backends``, with a table saying why for each peer in ``not_run``.
    """
    spec = SPECS[coll]
    dtype_name, op = combo
    dtype = DTYPES[dtype_name]
    elem = torch.empty(0, dtype=dtype).element_size()
    kind = {"collective": coll, "dtype": dtype_name, "op": op if spec.reducing else None}
    tables = {b.name: {"backend": b.name, **kind, "rows": [], "error": None, "skipped": None} for b in backends}
    refused = {
        item["backend"]: {
            "backend": item["backend"],
            **kind,
            "rows": [],
            "error": None,
            "skipped": f"not run: {item['reason']}",
            "wrong": 0,
            "avg_busbw": None,
        }
        for item in not_run
    }
    sizes = s.sizes
    if world < spec.min_world:
        for table in tables.values():
            table["skipped"] = f"{coll} needs at least {spec.min_world} ranks, this run has {world}"
        sizes = []
    out = TableStream(bar, coll, label) if rank == 0 else None
    if out is not None:
        skipped = [t for t in (*tables.values(), *refused.values()) if t["skipped"]]
        out.start([b.name for b in backends if not tables[b.name]["skipped"]], skipped)
    active = list(backends)
    seen = set()
    for size in sizes:
        count = spec.count_for(size, world, elem)
        actual = spec.size_bytes(count, world, elem)
        if actual in seen:  # rounding to whole elements maps several sizes to one
            continue
        seen.add(actual)
        case = Case(rank, world, count, dtype, device, op, s.root, seed, buffers)
        per_rank = ex.gather(_measure_rounds(spec, case, active, s, bar))
        if rank == 0:
            _record(spec, case, actual, per_rank, tables, out)
        # Rank 0 alone sees every rank's error: all ranks drop a failed backend from this
        # collective together, and go on with the others.
        failed = json.loads(ex.share(json.dumps([n for n, t in tables.items() if t["error"]]) if rank == 0 else None))
        active = [b for b in active if b.name not in failed]
        if not active:
            break
    if rank != 0:
        return []
    for table in tables.values():
        table["wrong"] = sum(r[v]["wrong"] or 0 for r in table["rows"] for v in VARIANTS if r[v])
        table["avg_busbw"] = avg_busbw(table["rows"])
    _add_ratios(list(tables.values()))
    out.end(list(tables.values()), s.rounds)
    every = {**tables, **refused}
    return [every[name] for name in s.backends if name in every]


def _add_ratios(tables: list[dict]) -> None:
    """Rank 0: give each cell of the first backend's table its time over each peer's, as ``ratio``.

    Where both ran at that size and variant; below 1, the first backend is faster.
    """
    first, peers = tables[0], [t for t in tables[1:] if t["rows"]]
    for row in first["rows"]:
        for variant in VARIANTS:
            cell = row[variant]
            if cell is None:
                continue
            cell["ratio"] = {}
            for peer in peers:
                other = next((r[variant] for r in peer["rows"] if r["size"] == row["size"]), None)
                if other is not None:
                    cell["ratio"][peer["backend"]] = cell["time_us"] / other["time_us"]


def _runnable(s: Settings, device: torch.device, world: int, local_world: int) -> tuple[list[str], list[dict]]:
    """The backends that can run here, and the peers that cannot with why; raises for the one under test."""
    runnable, skipped = [], []
    for i, name in enumerate(s.backends):
        reason = why_unavailable(name, device, world, local_world)
        if reason is None:
            runnable.append(name)
        elif i == 0:
            hint = " (try --backend gloo)" if name == "gpucomm" and not gpucomm_api_available() else ""
            raise ValueError(f"gpucomm-bench: backend {name} cannot run here: {reason}{hint}")
        else:
            skipped.append({"backend": name, "reason": reason})
    return runnable, skipped


def _start_backends(
    names: list[str], store: dist.Store, rank, world, device, s: Settings, skipped: list[dict]
) -> list[Backend]:
    """Start every backend at once, each on its own store prefix, so that rounds can alternate.

    torch's backends first: torch's default group is gpucomm's once gpucomm has one (one world),
    and torch refuses a second; gpucomm's default group stands beside a gloo or NCCL one."""
    started = []
    for name in sorted(names, key=lambda n: n == "gpucomm"):
        prefixed = dist.PrefixStore(f"bench/{name}", store)
        knobs = s.knobs if name == "gpucomm" else {}
        try:
            started.append(make_backend(name, prefixed, rank, world, device, knobs, s.timeout_s))
        except (RuntimeError, ValueError, TypeError) as err:
            if name == s.backends[0]:
                raise
            # A peer that cannot start here is reported, not allowed to sink the backend under test.
            skipped.append({"backend": name, "reason": f"init failed: {type(err).__name__}: {err}"})
    return sorted(started, key=lambda b: names.index(b.name))


def run_rank(s: Settings) -> int:
    """Run this rank (RANK/WORLD_SIZE/MASTER_* in the environment); 0 if every check passed."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    timeout = datetime.timedelta(seconds=s.timeout_s or DEFAULT_TIMEOUT_S)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    device = _device(s.device, local_rank)
    if not 0 <= s.root < world:
        raise ValueError(f"gpucomm-bench: -r/--root must be in [0, {world}), got {s.root}")
    ex = _Exchange(store, rank, world)
    seed = int(ex.share(str(s.seed if s.seed is not None else random.randrange(1 << 31)) if rank == 0 else None))
    infos = ex.gather(rank_info(device))

    runnable, skipped = _runnable(s, device, world, local_world)
    nccl = nccl_info(device, local_world) if "nccl" in runnable else None
    before = thread_ids()
    backends = _start_backends(runnable, store, rank, world, device, s, skipped)
    release(before)  # a bound rank's backends' own threads on every core (bench/service_threads.py)
    try:
        # What actually serves gpucomm's calls: its own defaults and GPUCOMM_* decide, not the bench.
        served = next((describe_gpucomm(b) for b in backends if b.name == "gpucomm"), None)
        plan = [(coll, combo) for coll in s.collectives for combo in combos(s.dtype, s.op, SPECS[coll].reducing)]
        bar = progress_bar(len(plan) * len(s.sizes) * s.rounds, rank == 0 and show_bar())
        if rank == 0:
            emit(bar, header_text(s, world, seed, served, device, infos, skipped, nccl))
        by_backend: dict[str, list[dict]] = {name: [] for name in s.backends}
        many = "all" in (s.dtype, s.op)  # -d all / -o all: each table's name says its dtype and op
        # Allocated once at the largest size asked, as nccl-tests does (they grow only for a row whose one
        # element per rank needs more than that).
        buffers = Buffers(device, max(s.sizes, default=0))
        for coll, combo in plan:
            label = combo_label(*combo, SPECS[coll].reducing) if many else ""
            tables = _run_collective(
                coll, combo, backends, rank, world, device, s, ex, bar, seed, skipped, label, buffers
            )
            for table in tables:
                by_backend[table["backend"]].append(table)
        bar.close()
    finally:
        for backend in backends:
            backend.close()
    # Backend by backend, as the JSON has always listed them.
    tables = [t for name in by_backend for t in by_backend[name]]

    failed = None
    if rank == 0:
        wrong = sum(t["wrong"] for t in tables)
        primary_errors = [t for t in tables if t["backend"] == s.backends[0] and t["error"]]
        failed = wrong > 0 or bool(primary_errors)
        verdict = (
            "# OK"
            if not failed
            else (
                f"# FAILED: {wrong} wrong value(s), {len(primary_errors)} collective(s) with errors on {s.backends[0]}"
            )
        )
        if s.json_path:
            write_report(s, world, seed, served, infos, skipped, tables, failed, nccl)
        if s.plot_path:
            from .plot import plot_tables

            plot_tables(
                tables, s.plot_path, f"gpucomm-bench, {world} ranks, {s.dtype} {s.op}, {infos[0]['device_name']}"
            )
        print(verdict, flush=True)
    code = int(ex.share(("1" if failed else "0") if rank == 0 else None))
    ex.close()
    return code
