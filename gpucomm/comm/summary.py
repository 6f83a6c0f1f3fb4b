"""The start-up summary: what ``GPUCOMM_DEBUG=INFO`` prints once, on rank 0, when the world is
made, as ``NCCL_DEBUG=INFO`` does: gpucomm's version, the world and its nodes, what serves each
device type's tensors (transport, kernels, channels, the algorithm chosen at a few sizes) and
the knobs set away from their defaults.

Only rank 0 prints it: the knobs that matter agree on every rank (gpucomm.comm.agreement), so
one rank's view is every rank's. Its lines start with ``gpucomm INFO [rank 0]``, apart from the per-call lines'
``gpucomm[rank N]:`` (gpucomm.log).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import platform
from collections.abc import Mapping, Sequence

import torch

from gpucomm.algorithms import select
from gpucomm.config import Config

__all__ = ["summary_lines", "knobs_set"]

# The sizes at which the summary says which all_reduce algorithm ``auto`` picks: a small, a
# middle and a large message of select's table (its thresholds lie between them).
_SIZES = ((4 << 10, "4K"), (1 << 20, "1M"), (64 << 20, "64M"))


def knobs_set(config: Config) -> dict[str, object]:
    """The knobs whose value differs from the default, as ``GPUCOMM_<NAME>``: value."""
    default = Config()
    return {
        f"GPUCOMM_{f.name.upper()}": getattr(config, f.name)
        for f in dataclasses.fields(Config)
        if getattr(config, f.name) != getattr(default, f.name)
    }


def _version() -> str:
    try:
        return importlib.metadata.version("gpucomm")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def summary_lines(
    rank: int,
    world_size: int,
    local_world_size: int,
    hosts: Sequence[str],
    engines: Mapping[str, object],
    device_types: Sequence[str],
    config: Config,
) -> list[str]:
    """The block's lines: ``local_world_size`` ranks make a node (gpucomm's layout, which
    ``GPUCOMM_LOCAL_WORLD_SIZE`` can make smaller than a host), ``hosts[r]`` is rank r's host;
    ``engines`` the workspace engine of each device type that has one (the others: gloo)."""
    # Not "gpucomm[rank N]:", the per-call lines' start, which scripts and tests pick them out by.
    head = f"gpucomm INFO [rank {rank}]"
    nodes: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        nodes.setdefault(host, []).append(r)
    lines = [
        f"{head} gpucomm {_version()}, torch {torch.__version__}, python {platform.python_version()}",
        f"{head} world: {world_size} ranks, {local_world_size} per node, on {len(nodes)} host(s): "
        + "; ".join(f"{host} ranks {_span(ranks)}" for host, ranks in nodes.items()),
    ]
    for device_type in device_types:
        engine = engines.get(device_type)
        if engine is None:
            lines.append(f"{head} {device_type} tensors: gloo (every collective through torch's gloo)")
            continue
        lines.append(f"{head} {device_type} tensors: {_served(engine, world_size, config)}")
    chosen = knobs_set(config)
    said = " ".join(f"{k}={v}" for k, v in chosen.items()) if chosen else "none (every knob at its default)"
    lines.append(f"{head} knobs set: {said}")
    return lines


def _served(engine: object, world_size: int, config: Config) -> str:
    topology = "hierarchical" if engine.topology.hierarchical else engine.transport  # type: ignore[attr-defined]
    kernels = getattr(engine.kernels, "label", engine.kernels.name)  # type: ignore[attr-defined]
    channels = str(engine.channels)  # type: ignore[attr-defined]
    if engine.channels_by_size and engine.channels > 1:  # type: ignore[attr-defined]
        channels += " (at most; fewer for small calls)"
    picks = " ".join(
        f"{label}={select.choose('all_reduce', nbytes, world_size, topology, config.algo)}" for nbytes, label in _SIZES
    )
    nodes = len(engine.topology.nodes)  # type: ignore[attr-defined]
    where = f", {nodes} nodes through gloo/NCCL between them" if nodes > 1 else ""
    return (
        f"workspace transport={engine.transport} kernels={kernels} channels={channels} "  # type: ignore[attr-defined]
        f"algo={config.algo} (all_reduce {picks}){where}"
    )


def _span(ranks: list[int]) -> str:
    """``0-3`` for consecutive ranks, else the list."""
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)
