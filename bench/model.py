"""A model of gpucomm's collectives on 8 x H100 read from its own programs, both ends of every link charged.

For each size, collective and algorithm this builds the programs gpucomm runs on every rank (the
real Builder and algorithms, on CPU tensors that are never touched: nothing is launched;
bench/programs.py) and times them round by round (bench/links.py). A round is the work between two
SYNCs; each rank runs its instructions (its *steps*) one after the other. Each step's bytes load:
its reader's inbound link and the outbound link of every rank whose memory it reads (a peer's
workspace slot or symmetric heap), and the reader's HBM, all at once (a step's loads and stores
move in lockstep). The steps in flight share every link and every HBM max-min fairly; a rank of
``grid`` channels draws at most grid/saturating_grid of its inbound link and HBM. A round ends
with its last step on any rank, plus one SYNC:

    T = launch + sum over rounds of (max-min fair time of the round's steps + sync if a SYNC ends it)

Copies are where the code puts them: a copy into the workspace is a step of its round (a COPY that
a REDUCE carries, flagged CARRIED, is part of that REDUCE's step: bench/links.py). The rows
(``--json``) give, per link rate (``link_gbs``: 0.82 and 0.57 x 450 GB/s by default), size, world,
collective, tensor kind (``ordinary``; for all_reduce also ``symmetric``: in the symmetric heap,
``multimem``: symmetric with NVLink SHARP, and ``captured``: an ordinary tensor in a CUDA graph
captured inside ``gpucomm.graph_capture()``, whose replays run the program
gpucomm.workspace.graph_buffers puts in place of the copy path) and algorithm, whether ``auto`` picks it
(gpucomm.algorithms.select and the engine's in-place rule), the device microseconds, NCCL's bus
bandwidth, and the phases: rounds with the same work merged (in the order they first occur), with
rank 0's bytes and SYNCs summed over them. The multimem path is no program; its row is counted by
construction (count_multimem).

Every input is a published figure or an assumption (docs/performance.md says which); none is
measured here. The link rate is an input: 0.82 x 450 GB/s is the share NCCL's (push) ring reaches
on 8 x H100 (370 GB/s bus bandwidth at 1 GiB); 0.57 x 450 is the rate at which the one published
pull-style two-shot (torch symmetric memory, 0.468 ms at 64 MiB, vLLM PR #42324) fits this model.
gpucomm's kernels pull: both stand until a GPU measures a pull.

Example::

    python -m gpucomm._bench.model --json model.json
    python -m gpucomm._bench.model --table model.json   # docs/performance.md's table
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from gpucomm.algorithms import select
from gpucomm.config import DEFAULT_WORKSPACE_BYTES
from gpucomm.ops.program import COPY, SYNC, Program, Slot, operands
from gpucomm.workspace.channels import MAX_CHANNELS, launch_channels
from gpucomm.workspace.graph_buffers import IN_PLACE_ALGOS

from . import links, programs
from .hostinfo import run_settings, write_json

__all__ = [
    "main",
    "build",
    "walk",
    "count",
    "count_multimem",
    "predict",
    "rows",
    "busbw",
    "crossover",
    "sync_share",
    "LINK_GBS",
    "LINK_RATES",
    "SIZES",
    "markdown",
]

NVLINK_GBS = 450.0  # NVLink 4, per direction per H100 (published)
# The shares of it the model is run at (module docstring): NCCL's push ring, and the published
# pull-style two-shot's fit.
LINK_RATES = (0.82, 0.57)
LINK_GBS = LINK_RATES[0] * NVLINK_GBS
ALGOS = ("oneshot", "twoshot", "ring", "tree")
# 8 B to 1 GiB, every power of two: the powers of 4 and 8 x the powers of 4.
SIZES = [1 << k for k in range(3, 31)]
# Workspaces whose SYNC share the model prints (how the default is chosen, gpucomm.config).
WORKSPACE_SIZES = [s << 20 for s in (8, 16, 32, 64, 128, 256)]
# The other collectives' rows: what auto picks, and for the rooted ones both forms (select's
# ROOTED_DIRECT_MAX_BYTES_GPU comes from them).
OTHERS = ("broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")


def _half_bytes(workspace_bytes: int) -> int:
    """The engine's half for a data area of ``workspace_bytes`` (gpucomm.workspace.layout)."""
    p2p = workspace_bytes // 4 // 256 * 256
    return (workspace_bytes - p2p) // 2 // 256 * 256


def build(
    algo: str, nbytes: int, world: int, rank: int, half_bytes: int, inplace: bool = False
) -> tuple[Program, list[int] | None]:
    """Rank ``rank``'s program of an all_reduce of ``nbytes`` (float32, SUM), and its heap bases
    (two-shot in place on a symmetric tensor where ``inplace``)."""
    return programs.build(
        "all_reduce", nbytes, world, rank, half_bytes, algo=algo, symmetric_tensor=inplace, force_in_place=inplace
    )


def walk(program: Program, world: int, rank: int, heap: Sequence[int] | None = None) -> tuple[int, list[dict]]:
    """(grid, rounds) of ``program`` on rank ``rank`` (bench/links.py), each round named by the kinds
    of its instructions."""
    grid, rounds = links.rounds(program, world, rank, heap)
    i = 0
    for ins in program.instructions:
        if ins[0] == SYNC:
            i += 1
            continue
        kinds = rounds[i].setdefault("kinds", [])
        kind = _kind(ins[:3] + tuple(operands(ins)) if ins[0] == COPY else ins, rank, heap)
        if kind not in kinds:
            kinds.append(kind)
    return grid, rounds


def _kind(ins: tuple, rank: int, heap: Sequence[int] | None) -> str:
    if ins[0] != COPY:
        return "reduce"
    dst, src = ins[3], ins[4]
    if isinstance(dst, Slot) and not isinstance(src, Slot):
        return "copy-in"
    if isinstance(src, Slot) and not isinstance(dst, Slot):
        return "copy-out"
    if isinstance(src, Slot):
        return "forward"
    return "gather" if links.remote_owner(src, rank, heap) is not None else "copy"


def _phases(walks: Sequence[tuple[int, list[dict]]]) -> list[dict]:
    """Rank 0's rounds with the same work merged: name, bytes (link in + HBM), SYNCs."""
    phases: dict[str, dict] = {}
    for r in walks[0][1]:
        kinds = r.get("kinds", [])
        if not kinds and not r["sync"]:
            continue
        name = "+".join(kinds) or "sync"
        phase = phases.setdefault(name, {"name": name, "link_bytes": 0, "hbm_bytes": 0, "syncs": 0})
        for step in r["steps"]:
            for (res, _owner), b in step:
                phase["link_bytes"] += b if res == "in" else 0
                phase["hbm_bytes"] += b if res == "hbm" else 0
        phase["syncs"] += int(r["sync"])
    return list(phases.values())


def _walks(collective: str, nbytes: int, world: int, half: int, algo: str, symmetric: bool = False) -> list:
    out = []
    for rank in range(world):
        program, heap = programs.build(collective, nbytes, world, rank, half, algo=algo, symmetric_tensor=symmetric)
        out.append(walk(program, world, rank, heap))
    return out


def _counted(walks: list, syncs: int) -> dict:
    grid, rounds = walks[0]
    steps = [step for r in rounds for step in r["steps"]]
    return {
        "syncs": syncs,
        "link_bytes": sum(b for step in steps for (res, _), b in step if res == "in"),
        "local_bytes": sum(b for step in steps for (res, _), b in step if res == "hbm"),
        "grid": grid,
        "walks": walks,
        "phases": _phases(walks),
    }


def count(
    algo: str, nbytes: int, world: int, half_bytes: int, symmetric: bool = False, p: argparse.Namespace | None = None
) -> dict:
    """What one all_reduce of ``nbytes`` costs, by the model.

    Its SYNCs, rank 0's inbound link bytes and HBM bytes, the grid, every rank's walk, the phases,
    and (``p`` given) the device us. ``symmetric``: two-shot in place on a symmetric tensor.
    """
    walks, syncs = [], []
    for rank in range(world):
        program, heap = build(algo, nbytes, world, rank, half_bytes, inplace=symmetric and algo == "twoshot")
        syncs.append(program.syncs)
        walks.append(walk(program, world, rank, heap))
    out = _counted(walks, syncs[0])
    if p is not None:
        out["device_us"] = links.program_us(walks, p)
    return out


def count_multimem(nbytes: int, world: int) -> dict:
    """What the multimem all_reduce (kernels/triton/multimem.py) on a symmetric tensor costs rank 0.

    By construction: a barrier, then ``multimem.ld_reduce`` and ``multimem.st`` of its 1/P of the
    tensor, then a barrier. Each GPU's NVLink carries, in its busier direction, the switch's reads of
    its copy for every rank's load-reduce (n) plus its own 1/P stored once (the switch fans it out):
    (1 + 1/P) n, against 2 (P-1)/P n for two-shot.
    """
    grid = launch_channels(max(1, nbytes // world), MAX_CHANNELS)
    link = nbytes + nbytes // world
    return {
        "syncs": 2,
        "link_bytes": link,
        "local_bytes": 0,
        "grid": grid,
        "multimem": True,
        "phases": [
            {"name": "barrier", "link_bytes": 0, "hbm_bytes": 0, "syncs": 1},
            {"name": "ld_reduce+st", "link_bytes": link, "hbm_bytes": 0, "syncs": 1},
        ],
    }


def predict(counts: dict, p: argparse.Namespace) -> float:
    """Device microseconds of one call counted by :func:`count` or :func:`count_multimem`."""
    if counts.get("multimem"):
        share = min(1.0, counts["grid"] / p.saturating_grid)
        return p.launch_us + counts["syncs"] * p.sync_us + counts["link_bytes"] / (p.multimem_gbs * 1e3 * share)
    return links.program_us(counts["walks"], p)


# NCCL's bus bandwidth factor per collective (its performance notes): bytes / time x factor.
_BUS = {"all_reduce": lambda P: 2 * (P - 1) / P, "all_gather": lambda P: (P - 1) / P}
_BUS.update(reduce_scatter=_BUS["all_gather"], all_to_all=_BUS["all_gather"])


def busbw(nbytes: int, us: float, world: int, collective: str = "all_reduce") -> float:
    """NCCL's bus bandwidth, GB/s: bytes / time x 2 (P - 1) / P for all_reduce, (P - 1) / P for
    all_gather, reduce_scatter and all_to_all, 1 for the rooted ones."""
    return nbytes / (us * 1e3) * _BUS.get(collective, lambda P: 1.0)(world)


def _row(collective: str, nbytes: int, world: int, tensor: str, algo: str, auto: bool, c: dict, p) -> dict:
    us = predict(c, p)
    return {
        "collective": collective,
        "link_gbs": round(p.link_gbs, 1),
        "size_bytes": nbytes,
        "world": world,
        "tensor": tensor,
        "algo": algo,
        "auto": auto,
        "device_us": round(us, 2),
        "busbw_gbps": round(busbw(nbytes, us, world, collective), 1),
        "phases": c["phases"],
    }


def _rates(p: argparse.Namespace) -> list[argparse.Namespace]:
    return [argparse.Namespace(**{**vars(p), "link_gbs": share * NVLINK_GBS}) for share in p.link_shares]


def rows(p: argparse.Namespace, sizes: Sequence[int] = SIZES, others: Sequence[str] = OTHERS) -> list[dict]:
    """Every size's rows of the model's table, at every link rate of ``p.link_shares``.

    all_reduce: each algorithm on an ordinary tensor; on a symmetric one the in-place two-shot and
    what the halves serve; multimem; what a captured graph on an ordinary tensor replays. ``auto``
    marks the row of what gpucomm picks for a float32 SUM (the engine runs two-shot in place on a
    symmetric tensor above one half; every captured row is auto's). ``others``: what auto runs, and
    broadcast and reduce both direct and spread.
    """
    half = _half_bytes(p.workspace_bytes)
    P = p.world
    rates = _rates(p)
    out = []
    for nbytes in sizes:
        pick = select.choose("all_reduce", nbytes, P, "cuda_ipc", "auto")
        counted = {algo: count(algo, nbytes, P, half) for algo in ALGOS}
        if nbytes <= select.SMALL_MAX_BYTES:
            # The small path (gpucomm.workspace.small) moves one-shot's bytes with one-shot's SYNC; what
            # it saves, the chain of dependent loads before a channel's first byte
            # (tests/ops/test_small_ptx.py), is a latency this model has no term for.
            counted[select.SMALL] = counted["oneshot"]
        # The engine's rule (Engine.serves): a symmetric tensor larger than a half goes in place.
        inplace = pick in ("oneshot", "twoshot") and nbytes > half
        symmetric = count("twoshot", nbytes, P, half, symmetric=True)
        rooted = {
            (c, a): _counted(_walks(c, nbytes, P, half, a), 0)
            for c in others
            for a in sorted(
                {programs.pick(c, nbytes, P)} | ({"direct", "spread"} if c in ("broadcast", "reduce") else set())
            )
        }
        for q in rates:
            for algo, c in counted.items():
                out.append(_row("all_reduce", nbytes, P, "ordinary", algo, algo == pick, c, q))
            for algo in [a for a in counted if a in ("oneshot", "twoshot", select.SMALL)]:
                out.append(
                    _row("all_reduce", nbytes, P, "symmetric", algo, algo == pick and not inplace, counted[algo], q)
                )
            out.append(_row("all_reduce", nbytes, P, "symmetric", "twoshot_inplace", inplace, symmetric, q))
            # A captured graph on an ordinary tensor (gpucomm.workspace.graph_buffers): where auto's
            # pick has the in-place two-shot's bits, its replays run that program at any size on the
            # users' own tensors; the small path keeps its own launch.
            if pick in IN_PLACE_ALGOS:
                out.append(_row("all_reduce", nbytes, P, "captured", "twoshot_inplace", True, symmetric, q))
            else:
                out.append(_row("all_reduce", nbytes, P, "captured", pick, True, counted[pick], q))
            # Float SUM: auto takes multimem only where its fold is exact (integer SUM, MIN, MAX).
            out.append(_row("all_reduce", nbytes, P, "multimem", "multimem", False, count_multimem(nbytes, P), q))
            for (c, a), counts in rooted.items():
                out.append(_row(c, nbytes, P, "ordinary", a, a == programs.pick(c, nbytes, P), counts, q))
    return out


def crossover(p: argparse.Namespace, worlds: Sequence[int] = range(2, 9), sizes: Sequence[int] = SIZES) -> list[dict]:
    """One-shot against two-shot on ordinary tensors, device us, at every world size in ``worlds``.

    Where gpucomm.algorithms.select's GPU thresholds come from.
    """
    half = _half_bytes(p.workspace_bytes)
    out = []
    for world in worlds:
        q = argparse.Namespace(**{**vars(p), "world": world})
        for nbytes in sizes:
            one, two = (count(a, nbytes, world, half, p=q)["device_us"] for a in ("oneshot", "twoshot"))
            out.append({"world": world, "size_bytes": nbytes, "oneshot_us": round(one, 2), "twoshot_us": round(two, 2)})
    return out


def sync_share(workspace_bytes: int, p: argparse.Namespace, nbytes: int = 1 << 30) -> float:
    """The share of a two-shot all_reduce of ``nbytes`` on an ordinary tensor that its SYNCs take.

    With a workspace of ``workspace_bytes``: how the default workspace size is chosen.
    """
    c = count("twoshot", nbytes, p.world, _half_bytes(workspace_bytes), p=p)
    return c["syncs"] * p.sync_us / c["device_us"]


# Published all_reduce figures on 8 GPUs set beside the model (docs/performance.md names their
# sources): (who, us). NCCL at 1 GiB from its published bus bandwidths (bytes x 1.75 / busbw).
PUBLISHED: dict[int, list[tuple[str, float]]] = {
    8: [("NCCL 2.27 symmetric kernels (8 x H800/H200)", 2.3), ("NCCL classic kernels (low end of 15-35)", 15.0)],
    512: [("SGLang", 5.9), ("vLLM custom AR", 10.0)],
    32 << 10: [("MSCCL++ (24 KB)", 6.2)],
    512 << 10: [("torch multimem", 11.0), ("NCCL", 24.0)],
    4 << 20: [("torch multimem", 27.0), ("NCCL", 50.0)],
    16 << 20: [("NCCL", 121.0)],
    64 << 20: [("NCCL", 316.0), ("torch symmetric-memory two-shot", 468.0)],
    128 << 20: [("NCCL NVLS (419 GB/s bus)", 561.0)],
    1 << 30: [("NCCL NVLS (~480 GB/s bus)", 3914.0), ("NCCL ring (370 GB/s bus)", 5078.0)],
}
# The table's sizes: 8 x the powers of 4, and the sizes with published figures.
TABLE_SIZES = sorted({8 << (2 * i) for i in range(14)} | set(PUBLISHED))


def _size_name(size: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if size >= 1 << shift:
            return f"{size >> shift} {unit}"
    return f"{size} B"


def _lead(ours: float, theirs: list[tuple[str, float]]) -> str:
    """Who leads a row: gpucomm (the model) or the fastest published figure, and by how much."""
    if not theirs:
        return ""
    who, us = min(theirs, key=lambda t: t[1])
    if ours <= us:
        return f"gpucomm, {us / ours:.2f}x ahead of {who}"
    return f"{who}, {ours / us:.2f}x ahead of gpucomm"


def markdown(rows_: Sequence[dict]) -> str:
    """docs/performance.md's table from the rows of a ``--json`` file.

    all_reduce: what ``auto`` runs on an ordinary tensor at each link rate, eagerly and replayed from a
    captured graph, on a symmetric tensor at the first rate, the published figures and who leads
    (eagerly) at each rate.
    """
    mine = [r for r in rows_ if r.get("collective", "all_reduce") == "all_reduce" and r["auto"]]
    rates = sorted({r["link_gbs"] for r in mine}, reverse=True)

    def find(tensor: str, size: int, rate: float) -> dict | None:
        found = [r for r in mine if r["size_bytes"] == size and r["tensor"] == tensor and r["link_gbs"] == rate]
        return found[0] if found else None

    def cell(r: dict | None) -> str:
        if r is None:
            return ""
        bus = f", {r['busbw_gbps']:.0f}" if r["size_bytes"] >= 2 << 20 else ""
        return f"{r['device_us']:.1f}{bus} ({r['algo']})"

    heads = [f"ordinary, link {rate:.0f} GB/s" for rate in rates]
    heads += [f"captured graph, link {rate:.0f} GB/s" for rate in rates]
    lines = [
        "| size | "
        + " | ".join(heads)
        + f" | symmetric, link {rates[0]:.0f} GB/s | published (us) | "
        + " | ".join(f"leads at {rate:.0f} GB/s" for rate in rates)
        + " |",
        "|---" * (3 + 3 * len(rates)) + "|",
    ]
    for size in TABLE_SIZES:
        theirs = PUBLISHED.get(size, [])
        ordinary = [find("ordinary", size, rate) for rate in rates]
        captured = [find("captured", size, rate) for rate in rates]
        lines.append(
            f"| {_size_name(size)} | "
            + " | ".join(cell(r) for r in ordinary + captured)
            + f" | {cell(find('symmetric', size, rates[0]))} | "
            + "; ".join(f"{who}: {us:g}" for who, us in theirs)
            + " | "
            + " | ".join(_lead(r["device_us"], theirs) if r else "" for r in ordinary)
            + " |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--workspace-bytes", type=int, default=DEFAULT_WORKSPACE_BYTES["cuda"])
    ap.add_argument("--launch-us", type=float, default=3.0, help="assumed: kernel start to first instruction")
    ap.add_argument("--sync-us", type=float, default=3.0, help="assumed: one flag round trip over NVLink")
    ap.add_argument(
        "--link-shares",
        type=float,
        nargs="+",
        default=list(LINK_RATES),
        help="NVLink per direction per H100 as shares of the published 450 GB/s, one set of rows each: "
        "0.82 (NCCL's push ring) and 0.57 (the published pull-style two-shot's fit)",
    )
    ap.add_argument(
        "--multimem-gbs",
        type=float,
        default=309.0,
        help="assumed: NVLink bytes per second per direction of multimem traffic, as NCCL's NVLS reaches it "
        "(its published 480 GB/s bus at 1 GiB moves (1 + 1/8) GiB per direction in 3.91 ms)",
    )
    ap.add_argument(
        "--hbm-gbs", type=float, default=3000.0, help="one H100's copy bandwidth (published, measured 2.97 TB/s)"
    )
    ap.add_argument("--saturating-grid", type=int, default=16, help="assumed: channels that saturate NVLink")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--table",
        metavar="JSON",
        help="print docs/performance.md's table from the rows of this --json file, nothing else",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.link_gbs = args.link_shares[0] * NVLINK_GBS  # the first rate: crossover, sync share
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)["rows"]))
        return 0
    table = rows(args)
    print(
        f"{'link':>5} {'collective':>14} {'bytes':>12} {'tensor':>9} {'algo':>15} {'auto':>4} {'device us':>10} "
        f"{'bus GB/s':>9}  phases (name: rank 0's link bytes in, HBM bytes, syncs)"
    )
    for r in table:
        phases = "; ".join(f"{ph['name']}: {ph['link_bytes']}, {ph['hbm_bytes']}, {ph['syncs']}" for ph in r["phases"])
        print(
            f"{r['link_gbs']:>5.0f} {r['collective']:>14} {r['size_bytes']:>12} {r['tensor']:>9} {r['algo']:>15} "
            f"{'*' if r['auto'] else '':>4} {r['device_us']:>10.2f} {r['busbw_gbps']:>9.1f}  {phases}"
        )
    shares_ = {ws: round(sync_share(ws, args), 3) for ws in WORKSPACE_SIZES}
    print("share of a 1 GiB two-shot all_reduce (ordinary tensor) spent in SYNCs, by GPUCOMM_WORKSPACE_BYTES:")
    print("  " + ", ".join(f"{ws >> 20} MiB: {share:.1%}" for ws, share in shares_.items()))
    if args.json:
        write_json(
            args.json,
            run_settings(args, half_bytes=_half_bytes(args.workspace_bytes)),
            rows=table,
            sync_share=shares_,
            crossover=crossover(args),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
