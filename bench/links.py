"""Both ends of every link: what each rank's steps load, how long a round takes, how even it is.

A program's *round* is the run of instructions between two SYNCs (gpucomm.ops.program); a rank's
*step* k of a round is its k-th instruction there. Every channel of a rank runs the same
instructions in the same order, each on its share of the bytes (gpucomm.workspace.channels), so a
rank is at its step k on all its channels at about the same time: step k of every rank is what
the links carry together.

A COPY is one move and one step of its own, except a COPY that a REDUCE carries
(``Builder.reduce``'s ``carry``, flagged CARRIED: the only fused form), which is part of that
REDUCE's step, its loads added to the fold's: the program kernels run it inside the fold's loop,
a share of the copy in every iteration between the fold's loads and its stores, so its loads are in
flight beside the fold's link reads (kernels/triton/program.py, kernels/cuda/program.cu).

Each step loads resources, in bytes:

- ``("out", o)``: the outbound link of rank o, for every byte a step reads from o's memory (a peer's
  workspace slot, or its copy of a symmetric tensor), or writes into it;
- ``("in", r)``: the inbound link of the reader r, for the same bytes (written bytes: the owner's);
- ``("hbm", r)``: the issuing rank's memory, for every byte it loads or stores.

:func:`round_us` times one round: every rank runs its steps one after the other; at each moment
the steps in flight share each resource max-min fairly (progressive filling, each step's rate in
its own bytes), a step's loads and stores of all its operands move in lockstep (the kernels load
every source of a vector before they fold or store it), and the round ends when the last rank's
last step does. A rank of ``grid`` channels draws at most grid/saturating_grid of its inbound link
and of its HBM. What it leaves out: the unevenness of channels within a rank (at most about one
granule a channel, tests/workspace/test_channel_balance.py) and ranks that run ahead across a
neighbour-only SYNC (ring, tree).

:func:`outbound_balance` is the link-balance measure: for every round and step k, the busiest
outbound link's bytes over the mean of all ranks' outbound bytes in that step.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from functools import lru_cache

from gpucomm.ops.program import COPY, SYNC, Program, Ref, Slot, carried, operands
from gpucomm.workspace.channels import MAX_CHANNELS
from gpucomm.workspace.device_executor import channel_layout

__all__ = ["remote_owner", "rounds", "round_us", "program_us", "outbound_balance"]

Step = tuple[tuple[tuple[str, int], int], ...]  # ((resource, rank), bytes) pairs, sorted


def remote_owner(operand: object, rank: int, heap: Sequence[int] | None) -> int | None:
    """The rank whose memory ``operand`` is in, where that is not ``rank``; else None."""
    if isinstance(operand, Slot):
        return None if operand.peer == rank else operand.peer
    if heap is not None and isinstance(operand, Ref) and len(heap) > 1:
        span = heap[1] - heap[0]
        owner = (operand.addr - heap[0]) // span
        return None if owner == rank or not 0 <= owner < len(heap) else owner
    return None


def _step(ins: tuple, rank: int, heap: Sequence[int] | None) -> Step:
    nbytes = ins[1]
    if ins[0] == COPY:
        dst, src = operands(ins)  # a COPY is one move
        reads, writes = [src], [dst]
    else:
        reads, writes = list(ins[4]), [ins[3], *ins[7:]]  # a REDUCE with STORE_ALSO stores twice
    load: dict[tuple[str, int], int] = {("hbm", rank): nbytes * (len(reads) + len(writes))}
    for operand, outward in [(r, True) for r in reads] + [(w, False) for w in writes]:
        owner = remote_owner(operand, rank, heap)
        if owner is not None:
            src, dst = (owner, rank) if outward else (rank, owner)
            load[("out", src)] = load.get(("out", src), 0) + nbytes
            load[("in", dst)] = load.get(("in", dst), 0) + nbytes
    return tuple(sorted(load.items()))


def rounds(program: Program, world: int, rank: int, heap: Sequence[int] | None = None) -> tuple[int, list[dict]]:
    """(grid, rounds) of rank ``rank``'s ``program``: each round's steps and whether a SYNC ends it."""
    grid, _ = channel_layout(program, world, MAX_CHANNELS)
    out = [{"steps": [], "sync": False}]
    for ins in program.instructions:
        if ins[0] == SYNC:
            out[-1]["sync"] = True
            out.append({"steps": [], "sync": False})
        elif carried(ins) and out[-1]["steps"]:
            # Run inside the REDUCE before it (the kernels' fused loop): one step, both loads together.
            merged = dict(out[-1]["steps"][-1])
            for res, b in _step(ins, rank, heap):
                merged[res] = merged.get(res, 0) + b
            out[-1]["steps"][-1] = tuple(sorted(merged.items()))
        else:
            out[-1]["steps"].append(_step(ins, rank, heap))
    return grid, out


def _fair_rates(flows: list[dict[tuple[str, int], float]], caps: dict[tuple[str, int], float]) -> list[float]:
    """Max-min fair rates (progressive filling) of flows that load resources by the given weights:
    every open flow rises to a common level until a resource fills; the flows on it stop there."""
    rates = [0.0] * len(flows)
    open_ = {f for f, flow in enumerate(flows) if flow}
    residual = dict(caps)
    level = 0.0
    while open_:
        weights = {res: sum(flows[f].get(res, 0.0) for f in open_) for res in residual}
        levels = {res: max(0.0, residual[res]) / w for res, w in weights.items() if w > 0}
        if not levels:
            break
        best = min(levels.values())
        tight = {res for res, lv in levels.items() if lv <= best * (1 + 1e-9)}
        for res, w in weights.items():
            residual[res] -= best * w
        level += best
        frozen = {f for f in open_ if any(flows[f].get(res, 0.0) > 0 for res in tight)}
        for f in frozen:
            rates[f] = level
        open_ -= frozen
    return rates


@lru_cache(maxsize=65536)
def round_us(per_rank: tuple[tuple[Step, ...], ...], caps: tuple[tuple[tuple[str, int], float], ...]) -> float:
    """Microseconds of one round: ``per_rank[r]`` is rank r's steps, ``caps`` bytes per us per resource."""
    capacity = dict(caps)
    queues = [list(steps) for steps in per_rank]
    left = [1.0 if q else 0.0 for q in queues]  # the share of each rank's current step still to move
    now = 0.0
    while any(queues):
        live = [r for r, q in enumerate(queues) if q]
        sizes = [max(b for _, b in queues[r][0]) for r in live]
        flows = [{res: b / size for res, b in queues[r][0]} for r, size in zip(live, sizes)]
        rates = _fair_rates(flows, capacity)  # in each step's own (largest-resource) bytes per us
        finish = [left[r] * size / rate if rate > 0 else float("inf") for r, size, rate in zip(live, sizes, rates)]
        dt = min(finish)
        if dt == float("inf"):
            raise RuntimeError("links.round_us: a step loads no resource with room")
        now += dt
        for r, size, rate, t in zip(live, sizes, rates, finish):
            if t <= dt * (1 + 1e-9):
                queues[r].pop(0)
                left[r] = 1.0
            else:
                left[r] -= dt * rate / size
    return now


def program_us(walks: Sequence[tuple[int, list[dict]]], p: argparse.Namespace) -> float:
    """Device microseconds of one call from every rank's :func:`rounds`: launch, then each round's
    time (:func:`round_us`, every rank starting together) plus its SYNC."""
    us = p.launch_us
    for i, mine in enumerate(walks[0][1]):
        per_rank = tuple(tuple(w[1][i]["steps"]) for w in walks)
        caps = []
        for r, (grid, _) in enumerate(walks):
            share = min(1.0, grid / p.saturating_grid)
            caps += [(("out", r), p.link_gbs * 1e3), (("in", r), p.link_gbs * 1e3 * share)]
            caps.append((("hbm", r), p.hbm_gbs * 1e3 * share))
        if any(per_rank):
            us += round_us(per_rank, tuple(caps))
        us += p.sync_us if mine["sync"] else 0.0
    return us


def outbound_balance(walks: Sequence[tuple[int, list[dict]]]) -> list[dict]:
    """For every round and step k that moves bytes over links: each end's load.

    Rows ``{round, step, busiest, mean, inbound, ratio}``: the busiest outbound link's bytes, the
    mean of all ranks' outbound bytes, the busiest inbound link's bytes, and
    ``busiest / max(mean, inbound)``. Where fewer ranks read than own the data (a root gathering),
    the busiest reader's inbound link carries what the busiest outbound one does, and the
    outbound end is not the narrow one: the bar is then the inbound link, not the mean.
    """
    world = len(walks)
    out = []
    for i in range(len(walks[0][1])):
        depth = max(len(w[1][i]["steps"]) for w in walks)
        for k in range(depth):
            load = {"out": [0] * world, "in": [0] * world}
            for w in walks:
                steps = w[1][i]["steps"]
                if k < len(steps):
                    for (kind, owner), b in steps[k]:
                        if kind in load:
                            load[kind][owner] += b
            total = sum(load["out"])
            if total:
                busiest, mean, inbound = max(load["out"]), total / world, max(load["in"])
                out.append(
                    {
                        "round": i,
                        "step": k,
                        "busiest": busiest,
                        "mean": mean,
                        "inbound": inbound,
                        "ratio": busiest / max(mean, inbound),
                    }
                )
    return out
