"""A model of all_reduce on 8 x H100 read from gpucomm's own programs: their critical path.

For each size and algorithm this builds the programs gpucomm runs on every rank (the real
Builder and algorithms, on CPU tensors that are never touched: nothing is launched), lays each
out on the program kernel's channels by the executor's own rule
(:func:`gpucomm.workspace.device_executor.channel_layout`) and walks it round by round. A round is the
work between two SYNCs; a channel runs its instructions one after the other, in the program's
order (a paired COPY, two copies whose loads the kernels keep in flight together, is one), so
within a round its time is the sum over its instructions of

    max(link_bytes / link_per_channel, (link_bytes + local_bytes) / hbm_per_channel)

where an instruction's link bytes are its operands in a peer's memory (a peer's workspace slot
or symmetric heap), its local bytes the others, and both are this channel's share of them. Each
channel has 1/max(grid, saturating_grid) of the link and of HBM. The round lasts as long as the
slowest channel of the slowest rank (a SYNC waits for the peers' same channel), plus one SYNC.

    T = launch + sum over rounds of (slowest channel + sync if the round ends in a SYNC)

Copies are where the code puts them: a copy into the workspace is part of its round's channel
time, overlapped with nothing. The rows (``--json``) give, per size, world, tensor kind
(``ordinary``, ``symmetric``: in the symmetric heap, ``multimem``: symmetric with NVLink SHARP)
and algorithm, whether ``auto`` (gpucomm.algorithms.select and the engine's in-place rule) picks
it, the device microseconds, the bus bandwidth, and the phases: rounds with the same work merged
(in the order they first occur), with rank 0's bytes per channel summed over them and their
SYNCs. The multimem path is no program; its row is counted by construction (count_multimem).

Every input is a published figure or an assumption (docs/performance.md says which); none is
measured here. NVLink runs at 0.82 x 450 GB/s, the share of it NCCL's ring reaches on 8 x H100
(370 GB/s bus bandwidth at 1 GiB), until a GPU measures gpucomm's.

Example::

    python -m gpucomm._bench.model --json model.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import torch

from gpucomm.algorithms import allreduce, select
from gpucomm.config import DEFAULT_WORKSPACE_BYTES
from gpucomm.ops.contract import Region
from gpucomm.ops.program import COPY, SYNC, Builder, Program, Ref, Slot
from gpucomm.reduce_op import ReduceOp
from gpucomm.workspace.channels import MAX_CHANNELS, launch_channels, shares
from gpucomm.workspace.device_executor import channel_layout

from .hostinfo import run_settings, write_json

__all__ = [
    "main",
    "build",
    "walk",
    "critical_path",
    "crossover",
    "count",
    "count_multimem",
    "predict",
    "rows",
    "busbw",
    "sync_share",
    "LINK_GBS",
    "SIZES",
    "markdown",
]

# NVLink 4: 450 GB/s per direction per H100 (published), of which NCCL's ring reaches 82%
# (370 GB/s bus bandwidth at 1 GiB on 8 x H100, published): the share a load-and-store
# algorithm gets until a GPU measures gpucomm's own.
LINK_GBS = 0.82 * 450.0
ALGOS = ("oneshot", "twoshot", "ring", "tree")
# 8 B to 1 GiB, every power of two: the powers of 4 and 8 x the powers of 4.
SIZES = [1 << k for k in range(3, 31)]
# Workspaces whose SYNC share the model prints (how the default is chosen, gpucomm.config).
WORKSPACE_SIZES = [s << 20 for s in (8, 16, 32, 64, 128, 256)]


def _half_bytes(workspace_bytes: int) -> int:
    """The engine's half for a data area of ``workspace_bytes`` (gpucomm.workspace.layout)."""
    p2p = workspace_bytes // 4 // 256 * 256
    return (workspace_bytes - p2p) // 2 // 256 * 256


def _heap(tensor: torch.Tensor, rank: int, world: int) -> list[int]:
    """Every rank's heap base as rank ``rank`` sees it, its own at ``tensor``.

    The peers' are at addresses nothing else uses: nothing is launched, they only tell its operands
    from theirs.
    """
    span = -(-tensor.numel() * tensor.element_size() // (1 << 30)) * (4 << 30)
    return [tensor.data_ptr() + (p - rank) * span for p in range(world)]


def build(
    algo: str, nbytes: int, world: int, rank: int, half_bytes: int, inplace: bool = False
) -> tuple[Program, list[int] | None]:
    """Rank ``rank``'s program of an all_reduce of ``nbytes`` (float32, SUM), and its heap bases.

    The heap bases are those it was built with where ``inplace`` (two-shot on a symmetric tensor).
    """
    tensor = torch.empty(max(1, nbytes // 4), dtype=torch.float32)  # never touched: no memory used
    heap = _heap(tensor, rank, world) if inplace else None
    b = Builder(rank, world, half_bytes, "all_reduce", (algo, nbytes), args=[Region.of(tensor)], heap=heap)
    if inplace:
        allreduce.twoshot_symmetric(b, tensor, ReduceOp.SUM)
    else:
        allreduce.run(algo, b, tensor, ReduceOp.SUM)
    return b.finish(), heap


def _remote(operand: object, rank: int, heap: Sequence[int] | None) -> bool:
    if isinstance(operand, Slot):
        return operand.peer != rank
    if heap is not None and isinstance(operand, Ref):
        mine = heap[rank]
        return not mine <= operand.addr < mine + (heap[1] - heap[0] if len(heap) > 1 else 0)
    return False


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
    return "gather" if _remote(src, rank, heap) else "copy"


def walk(
    program: Program, world: int, rank: int, heap: Sequence[int] | None = None, channels: int = MAX_CHANNELS
) -> tuple[int, list[dict]]:
    """(grid, rounds) of ``program`` on rank ``rank``.

    Each round's name (the kinds of its instructions), each channel's link and local bytes, and
    whether a SYNC ends it.
    """
    grid, granule = channel_layout(program, world, channels)
    rounds = [{"kinds": [], "link": [0] * grid, "local": [0] * grid, "sync": False, "steps": []}]
    for ins in program.instructions:
        if ins[0] == SYNC:
            rounds[-1]["sync"] = True
            rounds.append({"kinds": [], "link": [0] * grid, "local": [0] * grid, "sync": False, "steps": []})
            continue
        operands = list(ins[3:]) if ins[0] == COPY else [ins[3], *ins[4]]  # a paired COPY has 4
        remote = sum(_remote(r, rank, heap) for r in operands)
        split = shares(ins[2], ins[1], grid, granule)
        now = rounds[-1]
        pairs = [ins[:3] + ins[i : i + 2] for i in range(3, len(ins), 2)] if ins[0] == COPY else [ins]
        for kind in (_kind(one, rank, heap) for one in pairs):
            if kind not in now["kinds"]:
                now["kinds"].append(kind)
        now["steps"].append([(s * remote, s * (len(operands) - remote)) for s in split])
        for c, s in enumerate(split):
            now["link"][c] += s * remote
            now["local"][c] += s * (len(operands) - remote)
    return grid, rounds


def _channel_us(steps: list[list[tuple[int, int]]], grid: int, c: int, p: argparse.Namespace) -> float:
    """Channel ``c``'s time in a round: its instructions one after the other."""
    ways = max(grid, p.saturating_grid)
    link_ch, hbm_ch = p.link_gbs * 1e3 / ways, p.hbm_gbs * 1e3 / ways  # bytes per us
    return sum(max(step[c][0] / link_ch, (step[c][0] + step[c][1]) / hbm_ch) for step in steps)


def critical_path(walks: Sequence[tuple[int, list[dict]]], p: argparse.Namespace) -> tuple[float, list[dict]]:
    """(device us, phases) of one call from every rank's :func:`walk`.

    Each round is as long as its slowest channel on its slowest rank, plus its SYNC; phases as the
    module docstring says.
    """
    grid, first = walks[0]
    us = p.launch_us
    phases: dict[str, dict] = {}
    for i, mine in enumerate(first):
        slowest = max(max((_channel_us(w[1][i]["steps"], w[0], c, p) for c in range(w[0])), default=0.0) for w in walks)
        us += slowest + (p.sync_us if mine["sync"] else 0.0)
        if not mine["kinds"] and not mine["sync"]:
            continue
        name = "+".join(mine["kinds"]) or "sync"
        phase = phases.setdefault(name, {"name": name, "channel_bytes": [0] * grid, "syncs": 0})
        phase["channel_bytes"] = [a + b + c for a, b, c in zip(phase["channel_bytes"], mine["link"], mine["local"])]
        phase["syncs"] += int(mine["sync"])
    return us, list(phases.values())


def count(
    algo: str, nbytes: int, world: int, half_bytes: int, symmetric: bool = False, p: argparse.Namespace | None = None
) -> dict:
    """What one all_reduce of ``nbytes`` costs, by the model.

    Its SYNCs, rank 0's NVLink and local bytes, the grid, and (``p`` given) the device us and phases
    of its critical path. ``symmetric``: two-shot in place on a symmetric tensor.
    """
    walks = []
    for rank in range(world if p is not None else 1):
        program, heap = build(algo, nbytes, world, rank, half_bytes, inplace=symmetric and algo == "twoshot")
        if rank == 0:
            syncs = program.syncs
        walks.append(walk(program, world, rank, heap))
    grid, rounds = walks[0]
    out = {
        "syncs": syncs,
        "link_bytes": sum(sum(r["link"]) for r in rounds),
        "local_bytes": sum(sum(r["local"]) for r in rounds),
        "grid": grid,
        "walks": walks,
    }
    if p is not None:
        out["device_us"], out["phases"] = critical_path(walks, p)
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
            {"name": "barrier", "channel_bytes": [0] * grid, "syncs": 1},
            {"name": "ld_reduce+st", "channel_bytes": [link // grid] * grid, "syncs": 1},
        ],
    }


def predict(counts: dict, p: argparse.Namespace) -> float:
    """Device microseconds of one call counted by :func:`count` or :func:`count_multimem`."""
    if counts.get("multimem"):
        share = min(1.0, counts["grid"] / p.saturating_grid)
        return p.launch_us + counts["syncs"] * p.sync_us + counts["link_bytes"] / (p.multimem_gbs * 1e3 * share)
    if "device_us" in counts:
        return counts["device_us"]
    return critical_path(counts["walks"], p)[0]


def busbw(nbytes: int, us: float, world: int) -> float:
    """NCCL's bus bandwidth of an all_reduce, GB/s: bytes / time * 2 (P - 1) / P."""
    return nbytes / (us * 1e3) * 2 * (world - 1) / world


def _row(nbytes: int, world: int, tensor: str, algo: str, auto: bool, c: dict, p: argparse.Namespace) -> dict:
    us = predict(c, p)
    return {
        "size_bytes": nbytes,
        "world": world,
        "tensor": tensor,
        "algo": algo,
        "auto": auto,
        "device_us": round(us, 2),
        "busbw_gbps": round(busbw(nbytes, us, world), 1),
        "phases": c["phases"],
    }


def rows(p: argparse.Namespace, sizes: Sequence[int] = SIZES) -> list[dict]:
    """Every size's rows of the model's table.

    Each algorithm on an ordinary tensor; on a symmetric one the in-place two-shot and what the
    halves serve; multimem. ``auto`` marks the row of what gpucomm picks for a float32 SUM (the
    engine runs two-shot in place on a symmetric tensor above one half).
    """
    half = _half_bytes(p.workspace_bytes)
    P = p.world
    out = []
    for nbytes in sizes:
        pick = select.choose("all_reduce", nbytes, P, "cuda_ipc", "auto")
        counted = {algo: count(algo, nbytes, P, half, p=p) for algo in ALGOS}
        if nbytes <= select.SMALL_MAX_BYTES:
            # The small path (gpucomm.workspace.small) moves one-shot's bytes with one-shot's SYNC on the
            # same grid; what it saves, the chain of dependent loads before a channel's first
            # byte (tests/ops/test_small_ptx.py), is a latency this model has no term for.
            counted[select.SMALL] = counted["oneshot"]
        for algo, c in counted.items():
            out.append(_row(nbytes, P, "ordinary", algo, algo == pick, c, p))
        # The engine's rule (Engine.serves): a symmetric tensor larger than a half goes in place.
        inplace = pick in ("oneshot", "twoshot") and nbytes > half
        for algo in [a for a in counted if a in ("oneshot", "twoshot", select.SMALL)]:
            out.append(_row(nbytes, P, "symmetric", algo, algo == pick and not inplace, counted[algo], p))
        c = count("twoshot", nbytes, P, half, symmetric=True, p=p)
        out.append(_row(nbytes, P, "symmetric", "twoshot_inplace", inplace, c, p))
        # Float SUM: auto takes multimem only where its fold is exact (integer SUM, MIN, MAX).
        out.append(_row(nbytes, P, "multimem", "multimem", False, count_multimem(nbytes, P), p))
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


# Published 8 x H100 all_reduce figures set beside the model (docs/performance.md names their
# sources): NCCL's, in us (bus GB/s at 1 GiB), and other libraries' (the anchors).
PUBLISHED = {
    8: ("15-35 us", "NCCL symmetric kernels ~5-7 us"),
    512: ("15-35 us", "SGLang 5.9 us, vLLM custom AR ~10 us"),
    8 << 10: ("15-35 us", ""),
    32 << 10: ("", "MSCCL++ 6.2 us at 24 KB"),
    512 << 10: ("24 us", "torch multimem 11 us"),
    4 << 20: ("50 us", "torch multimem 27 us"),
    16 << 20: ("121 us", ""),
    64 << 20: ("316 us", ""),
    1 << 30: ("~5080 us (ring, 370 GB/s)", "NCCL NVLS ~3910 us (480 GB/s)"),
}
# The table's sizes: 8 x the powers of 4, and the sizes with published figures.
TABLE_SIZES = sorted({8 << (2 * i) for i in range(14)} | set(PUBLISHED))


def markdown(rows_: Sequence[dict]) -> str:
    """docs/performance.md's table from the rows of a ``--json`` file.

    What ``auto`` runs on an ordinary and on a symmetric tensor, the multimem path, and the
    published figures.
    """

    def cell(tensor: str, size: int, auto: bool = True) -> str:
        found = [r for r in rows_ if r["size_bytes"] == size and r["tensor"] == tensor and (r["auto"] or not auto)]
        if not found:
            return ""
        r = found[0]
        bus = f", {r['busbw_gbps']:.0f}" if size >= 2 << 20 else ""
        return f"{r['device_us']:.1f}{bus} ({r['algo']})"

    lines = [
        "| size | ordinary (auto) | symmetric (auto) | multimem (symmetric) | NCCL (published) | others (published) |",
        "|---|---|---|---|---|---|",
    ]
    for size in TABLE_SIZES:
        nccl, others = PUBLISHED.get(size, ("", ""))
        name = (
            f"{size >> 30} GiB"
            if size >= 1 << 30
            else f"{size >> 20} MiB"
            if size >= 1 << 20
            else f"{size >> 10} KiB"
            if size >= 1 << 10
            else f"{size} B"
        )
        lines.append(
            f"| {name} | {cell('ordinary', size)} | {cell('symmetric', size)} | "
            f"{cell('multimem', size, auto=False)} | {nccl} | {others} |"
        )
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--workspace-bytes", type=int, default=DEFAULT_WORKSPACE_BYTES["cuda"])
    ap.add_argument("--launch-us", type=float, default=3.0, help="assumed: kernel start to first instruction")
    ap.add_argument("--sync-us", type=float, default=3.0, help="assumed: one flag round trip over NVLink")
    ap.add_argument(
        "--link-gbs",
        type=float,
        default=LINK_GBS,
        help="NVLink per direction per H100: 0.82 x the published 450 GB/s, NCCL's ring's share",
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
    if args.table:
        with open(args.table) as f:
            print(markdown(json.load(f)["rows"]))
        return 0
    table = rows(args)
    print(
        f"{'bytes':>12} {'tensor':>9} {'algo':>15} {'auto':>4} {'device us':>10} {'bus GB/s':>9}  "
        "phases (name: busiest channel bytes, syncs)"
    )
    for r in table:
        phases = "; ".join(f"{ph['name']}: {max(ph['channel_bytes'], default=0)}, {ph['syncs']}" for ph in r["phases"])
        print(
            f"{r['size_bytes']:>12} {r['tensor']:>9} {r['algo']:>15} {'*' if r['auto'] else '':>4} "
            f"{r['device_us']:>10.2f} {r['busbw_gbps']:>9.1f}  {phases}"
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
