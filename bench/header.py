"""What a collective run's header and JSON say: the settings, each rank's process, cores and
threads, the path gpucomm served, NCCL's layout."""

from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import asdict
from typing import TYPE_CHECKING

import torch

from .backends import NCCL_MULTI_RANK_ENV, nccl_shares_gpus, nccl_version
from .hostinfo import device_name, versions
from .service_threads import spread_cores
from .threads import current_threads

if TYPE_CHECKING:
    from .runner import Settings

__all__ = ["rank_info", "cores_text", "header_text", "threads_line", "nccl_info", "write_report"]


def rank_info(device: torch.device) -> dict:
    """This rank's process, host, device, cores, and torch's thread count with where it came from."""
    threads, why = current_threads()
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "device": str(device),
        "device_name": device_name(device),
        "cores": sorted(os.sched_getaffinity(0)),
        "threads": threads,
        "threads_from": why,
        # Where the threads the rank's backends start for themselves run (None: with the rank).
        "backend_threads_cores": spread_cores(),
    }


def cores_text(cores: list[int]) -> str:
    return ",".join(map(str, cores)) if len(cores) <= 4 else f"{len(cores)} cores"


def gpucomm_line(served: dict, device: torch.device) -> str:
    """The path that served this run's tensors, then the knobs as gpucomm resolved them.

    ``# gpucomm: cpu tensors -> workspace transport=shm kernels=torch (transport=auto ...)``
    """
    config = served["config"]
    knobs = " ".join(f"{k}={config[k]}" for k in ("transport", "kernels", "algo", "check"))
    return f"# gpucomm: {device.type} tensors -> {served['paths'][device.type]} ({knobs})"


def header_text(s: Settings, world, seed, served, device, infos, skipped, nccl) -> str:
    timing = "# time: per iteration the slowest rank's, median over iterations"
    if s.graph_launches:
        timing = (
            f"# time: {s.iters} iterations captured into a CUDA graph, replayed {s.graph_launches} times; "
            "per replay the slowest rank's time per iteration, median over replays"
        )
    if s.rounds > 1:
        timing += f", median over {s.rounds} rounds (backends in alternating order)"
    step = f"{s.step_bytes}(bytes)" if s.step_bytes else f"{s.step_factor:g}(factor)"
    lines = [
        f"# gpucomm-bench {' '.join(s.argv)}",
        f"# world {world}  minBytes {s.sizes[0]}  maxBytes {s.max_bytes or s.sizes[-1]}  "
        f"step: {step}  warmup iters: {s.warmup}  iters: {s.iters}  "
        f"validation: {int(s.check)}  seed: {seed}",
        f"# dtype {s.dtype}  op {s.op}  root {s.root}  backends: {', '.join(s.backends)}",
        f"{timing} ({'CUDA events' if device.type == 'cuda' else 'wall clock'})",
    ]
    if s.check:
        after = "the graph's replays" if s.graph_launches else "the timed calls"
        lines.append(f"# check: one call after {after}, inputs reset before it, on every rank")
    if served is not None:
        lines.append(gpucomm_line(served, device))
    if nccl is not None and nccl["multi_rank_gpu"]:
        lines.append(
            f"# nccl: NCCL {nccl['version']}, {nccl['local_ranks']} local ranks on {nccl['gpus']} GPU(s): "
            f"{NCCL_MULTI_RANK_ENV}=1 in the ranks' environment, as gpucomm's ranks share them"
        )
    for item in skipped:
        lines.append(f"# {item['backend']}: not run: {item['reason']}")
    lines.append(threads_line(infos))
    lines.append("#\n# Using devices")
    for r, info in enumerate(infos):
        lines.append(
            f"#  Rank {r:2d} Pid {info['pid']:6d} on {info['host']} device {info['device']} [{info['device_name']}]"
            f" cores {cores_text(info['cores'])} threads {info['threads']}"
        )
    return "\n".join(lines)


def threads_line(infos: list[dict]) -> str:
    """``# threads: 1 per rank (bound to 1 core (--bind))``, or each rank's where they differ."""
    counts = {(info["threads"], info["threads_from"]) for info in infos}
    # bench/service_threads.py: a bound rank's backends run their own threads on these cores.
    spread = {tuple(info.get("backend_threads_cores") or ()) for info in infos}
    backends = ""
    if len(spread) == 1 and (cores := spread.pop()):
        backends = f"; the backends' own threads on cores {cores_text(list(cores))}"
    if len(counts) == 1:
        threads, why = counts.pop()
        return f"# threads: torch runs {threads} per rank ({why}){backends}"
    each = ", ".join(f"rank {r}: {info['threads']} ({info['threads_from']})" for r, info in enumerate(infos))
    return f"# threads: torch runs {each}{backends}"


def nccl_info(device: torch.device, local_world: int) -> dict:
    """The NCCL this run's nccl rows come from, and whether its ranks share GPUs."""
    version, gpus = nccl_version(), torch.cuda.device_count()
    return {
        "version": ".".join(map(str, version)) if version else None,
        "gpus": gpus,
        "local_ranks": local_world,
        "multi_rank_gpu": nccl_shares_gpus(version, gpus, local_world),
        NCCL_MULTI_RANK_ENV: os.environ.get(NCCL_MULTI_RANK_ENV),
    }


def write_report(s: Settings, world, seed, served, infos, skipped, tables, failed, nccl) -> None:
    settings = asdict(s)
    settings.update(
        nccl=nccl,
        world_size=world,
        seed=seed,
        gpucomm_knobs=s.knobs if "gpucomm" in s.backends else None,
        gpucomm=served,
        host=infos[0]["host"],
        device_name=infos[0]["device_name"],
        ranks=infos,
        versions=versions(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    with open(s.json_path, "w") as f:
        json.dump({"settings": settings, "tables": tables, "skipped": skipped, "failed": failed}, f, indent=1)
