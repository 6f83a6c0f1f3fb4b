"""One rank of a collective benchmark: every backend × collective × size, checked and timed.

Every rank measures; rank 0 collects the other ranks' numbers through the rendezvous store
(not through the backend under test, so that a broken backend cannot corrupt its own report),
averages the per-rank medians and prints the tables.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import socket
import sys
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from .backends import Backend, gpucomm_api_available, make_backend, why_unavailable
from .collectives import SPECS, Case, poison_value
from .hostinfo import device_name, versions
from .report import VARIANTS, avg_busbw, table_footer, table_header, table_row
from .timing import time_calls

__all__ = ["Settings", "run_rank", "DTYPES", "PLANT_ERROR_ENV"]

DTYPES = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
}

# Test-only: corrupt one checked element on every checking rank, to prove a wrong result fails
# the run. Not a CLI option, so that nobody reaches for it by accident.
PLANT_ERROR_ENV = "GPUCOMM_BENCH_PLANT_ERROR"

# Defaults gpucomm gets on CPU unless the user names them: the shared-memory workspace with the
# torch reference kernels (Triton on CPU only runs under its slow interpreter).
CPU_GPUCOMM_KNOBS = {"transport": "shm", "kernels": "torch"}


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
    knobs: dict[str, str]
    device: str  # auto | cpu | cuda
    timeout_s: float
    seed: int | None
    json_path: str | None
    plot_path: str | None
    argv: list[str] = field(default_factory=list)
    step_factor: float = 2.0
    max_bytes: int = 0  # as asked (-e); the last row may be smaller


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


def _measure(spec, case: Case, backend, inplace: bool, s: Settings) -> dict | None:
    """This rank's median time and wrong-element count for one variant, None if it has none."""
    prepared = spec.prepare(case, backend.mod, backend.op(case.op), inplace)
    if prepared is None:
        return None
    wrong = None
    if s.check:
        prepared.reset()
        prepared.call()
        if case.device.type == "cuda":
            torch.cuda.synchronize(case.device)
        if prepared.result is None:
            wrong = 0
        else:
            if os.environ.get(PLANT_ERROR_ENV) == "1":
                _plant_error(prepared.result)
            wrong = int((prepared.result != prepared.expected()).sum().item())
    prepared.reset()
    backend.mod.barrier()
    seconds = time_calls(prepared.call, case.device, s.warmup, s.iters)
    return {"seconds": seconds, "wrong": wrong}


def _row(spec, case: Case, size: int, per_rank: list[dict], s: Settings) -> dict:
    """Rank 0: average the per-rank medians into one nccl-tests row."""
    row = {
        "size": size,
        "count": case.count,
        "type": s.dtype,
        "redop": case.op if spec.reducing else "none",
        "root": case.root if spec.rooted else -1,
    }
    for variant in VARIANTS:
        cells = [p[variant] for p in per_rank]
        if any(c is None for c in cells):
            row[variant] = None
            continue
        seconds = sum(c["seconds"] for c in cells) / len(cells)
        algbw = size / seconds / 1e9
        wrongs = [c["wrong"] for c in cells]
        row[variant] = {
            "time_us": seconds * 1e6,
            "algbw": algbw,
            "busbw": algbw * spec.factor(case.world),
            "wrong": None if None in wrongs else sum(wrongs),
            "rank_time_us": [c["seconds"] * 1e6 for c in cells],
        }
    return row


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    # A terminal gets the bar at once; a log (CI, a pipe) only once the run has lasted a while.
    return tqdm(total=total, file=sys.stderr, disable=not enabled, leave=False, unit="row",
                delay=0 if sys.stdout.isatty() else 10)


def _emit(bar, text: str) -> None:
    """Print a report line; where stdout and the bar share a terminal, without tearing the bar."""
    if not bar.disable and sys.stdout.isatty() and sys.stderr.isatty():
        bar.write(text, file=sys.stdout)
    else:
        print(text, flush=True)


def _run_backend(backend: Backend, rank, world, device, s: Settings, ex: _Exchange, bar, seed: int) -> list[dict]:
    """All collectives on one started backend; returns rank 0's tables (empty list elsewhere)."""
    name = backend.name
    tables = []
    dtype = DTYPES[s.dtype]
    elem = torch.empty(0, dtype=dtype).element_size()
    try:
        for coll in s.collectives:
            spec = SPECS[coll]
            table = {"backend": name, "collective": coll, "rows": [], "error": None, "skipped": None}
            if rank == 0:
                _emit(bar, f"#\n# Collective test: {coll}    backend: {name}\n#\n{table_header()}")
            if world < spec.min_world:
                table["skipped"] = f"{coll} needs at least {spec.min_world} ranks, this run has {world}"
            seen = set()
            for size in s.sizes if table["skipped"] is None else ():
                count = spec.count_for(size, world, elem)
                actual = spec.size_bytes(count, world, elem)
                if actual in seen:  # rounding to whole elements maps several sizes to one
                    continue
                seen.add(actual)
                case = Case(rank, world, count, dtype, device, s.op, s.root, seed)
                try:
                    payload = {v: _measure(spec, case, backend, v == "in_place", s) for v in VARIANTS}
                except (RuntimeError, ValueError, TypeError) as err:
                    # Reported in the table (and failing the run for the backend under test);
                    # a backend refusing e.g. AVG on integers should not hide the others' results.
                    payload = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
                per_rank = ex.gather(payload)
                if rank == 0:
                    bar.update(1)
                    errors = [f"rank {r}: {p['error']}" for r, p in enumerate(per_rank) if "error" in p]
                    if errors:
                        table["error"] = "; ".join(errors)
                    else:
                        row = _row(spec, case, actual, per_rank, s)
                        table["rows"].append(row)
                        _emit(bar, table_row(row))
                # Rank 0 alone sees every rank's error: all ranks stop this collective together.
                if ex.share(("stop" if table["error"] else "go") if rank == 0 else None) == "stop":
                    break
            if rank == 0:
                table["wrong"] = sum(r[v]["wrong"] or 0 for r in table["rows"] for v in VARIANTS if r[v])
                table["avg_busbw"] = avg_busbw(table["rows"])
                if table["error"]:
                    _emit(bar, f"# ERROR: {table['error']}")
                if table["skipped"]:
                    _emit(bar, f"# skipped: {table['skipped']}")
                _emit(bar, table_footer(table["rows"], table["wrong"]))
                tables.append(table)
    finally:
        backend.close()
    return tables


def _rank_info(device: torch.device) -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "device": str(device), "device_name": device_name(device)}


def run_rank(s: Settings) -> int:
    """Run this rank (RANK/WORLD_SIZE/MASTER_* in the environment); 0 if every check passed."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    store, rank, world = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=s.timeout_s)))
    device = _device(s.device, local_rank)
    if not 0 <= s.root < world:
        raise ValueError(f"gpucomm-bench: -r/--root must be in [0, {world}), got {s.root}")
    ex = _Exchange(store, rank, world)
    seed = int(ex.share(str(s.seed if s.seed is not None else random.randrange(1 << 31)) if rank == 0 else None))
    infos = ex.gather(_rank_info(device))

    knobs = dict(s.knobs)
    cpu_defaults = {}
    if device.type == "cpu":
        cpu_defaults = {k: v for k, v in CPU_GPUCOMM_KNOBS.items() if k not in knobs}
        knobs.update(cpu_defaults)
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

    bar = _progress(len(runnable) * len(s.collectives) * len(s.sizes), rank == 0)
    if rank == 0:
        _emit(bar, _header(s, world, seed, knobs, cpu_defaults, infos, skipped))
    tables = []
    for name in runnable:
        prefixed = dist.PrefixStore(f"bench/{name}", store)
        try:
            backend = make_backend(name, prefixed, rank, world, device, knobs if name == "gpucomm" else {}, s.timeout_s)
        except (RuntimeError, ValueError, TypeError) as err:
            if name == s.backends[0]:
                raise
            # A peer that cannot start here is reported, not allowed to sink the backend under test.
            skipped.append({"backend": name, "reason": f"init failed: {type(err).__name__}: {err}"})
            if rank == 0:
                _emit(bar, f"# {name}: not run: {skipped[-1]['reason']}")
            continue
        tables += _run_backend(backend, rank, world, device, s, ex, bar, seed)
    bar.close()

    failed = None
    if rank == 0:
        wrong = sum(t["wrong"] for t in tables)
        primary_errors = [t for t in tables if t["backend"] == s.backends[0] and t["error"]]
        failed = wrong > 0 or bool(primary_errors)
        verdict = "# OK" if not failed else (
            f"# FAILED: {wrong} wrong value(s), {len(primary_errors)} collective(s) with errors on {s.backends[0]}"
        )
        if s.json_path:
            _write_json(s, world, seed, knobs, infos, skipped, tables, failed)
        if s.plot_path:
            from .plot import plot_tables

            plot_tables(tables, s.plot_path, f"gpucomm-bench, {world} ranks, {s.dtype} {s.op}, {infos[0]['device_name']}")
        print(verdict, flush=True)
    code = int(ex.share(("1" if failed else "0") if rank == 0 else None))
    ex.close()
    return code


def _header(s: Settings, world, seed, knobs, cpu_defaults, infos, skipped) -> str:
    lines = [
        f"# gpucomm-bench {' '.join(s.argv)}",
        f"# world {world}  minBytes {s.sizes[0]}  maxBytes {s.max_bytes or s.sizes[-1]}  step: {s.step_factor:g}(factor)"
        f"  warmup iters: {s.warmup}  iters: {s.iters}  validation: {int(s.check)}  seed: {seed}",
        f"# dtype {s.dtype}  op {s.op}  root {s.root}  backends: {', '.join(s.backends)}",
        "# time: median over iterations of each rank, averaged over ranks"
        f" ({'CUDA events' if infos[0]['device'].startswith('cuda') else 'wall clock'})",
    ]
    if "gpucomm" in s.backends:
        shown = " ".join(f"{k}={v}" for k, v in sorted(knobs.items())) or "auto"
        lines.append(f"# gpucomm knobs: {shown}")
        if cpu_defaults:
            shown = " ".join(f"{k}={v}" for k, v in sorted(cpu_defaults.items()))
            lines.append(
                f"# CPU run: {shown} by default (gpucomm on CPU = its shared-memory workspace path with "
                "the torch kernels; --transport/--kernels override)"
            )
    for item in skipped:
        lines.append(f"# {item['backend']}: not run: {item['reason']}")
    lines.append("#\n# Using devices")
    for r, info in enumerate(infos):
        lines.append(f"#  Rank {r:2d} Pid {info['pid']:6d} on {info['host']} device {info['device']} [{info['device_name']}]")
    return "\n".join(lines)


def _write_json(s: Settings, world, seed, knobs, infos, skipped, tables, failed) -> None:
    settings = asdict(s)
    settings.update(
        world_size=world,
        seed=seed,
        gpucomm_knobs=knobs if "gpucomm" in s.backends else None,
        host=infos[0]["host"],
        device_name=infos[0]["device_name"],
        ranks=infos,
        versions=versions(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    with open(s.json_path, "w") as f:
        json.dump({"settings": settings, "tables": tables, "skipped": skipped, "failed": failed}, f, indent=1)
