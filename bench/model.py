"""An alpha-beta model of all_reduce on 8 x H100, fed with gpucomm's own programs.

For each algorithm (one-shot, two-shot, ring, tree) and size, this builds the program gpucomm
runs for rank 0 of 8 (the real Builder and algorithms, on CPU tensors: nothing is launched) and
counts what the model needs: SYNCs on the path, bytes rank 0 moves over NVLink (operands in a
peer's workspace) and through its own memory, and the grid gpucomm.channels gives the launch.
Then, with the parameters below (every one an assumption or a published figure, none measured
here), it predicts the device time of one call:

    T = launch + syncs * sync + max(link_bytes / (link_bw * min(1, grid / saturating_grid)),
                                    (local_bytes + link_bytes) / hbm_bw)

and the eager time, with ``host`` microseconds of Python per call added. docs/performance.md
explains the model and compares it with published numbers.

Example::

    python -m gpucomm._bench.model --json model.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from gpucomm.algorithms import allreduce
from gpucomm.channels import MAX_CHANNELS, launch_channels
from gpucomm.config import DEFAULT_WORKSPACE_BYTES
from gpucomm.ops.contract import Region
from gpucomm.program import COPY, REDUCE, SYNC, Builder, Ref, Slot
from gpucomm.reduce_op import ReduceOp

from .hostinfo import run_settings, write_json

__all__ = ["main", "count", "count_multimem", "predict", "serial_us", "table", "sync_share", "busbw"]

ALGOS = ("oneshot", "twoshot", "ring", "tree")
# 8 B to 8 GiB, a factor of 4 apart (plus 512 B, SGLang's published point, 1 GiB and 4 MiB, the
# published multimem points, and 8 GiB itself).
SIZES = sorted({8 << (2 * i) for i in range(16)} | {512, 4 << 20, 1 << 30, 8 << 30})
# Workspaces whose SYNC share the model prints (the default's choice, gpucomm.config).
WORKSPACE_SIZES = [s << 20 for s in (8, 16, 32, 64, 128, 256)]


def _half_bytes(workspace_bytes: int) -> int:
    """The engine's half for a data area of ``workspace_bytes`` (gpucomm.engine's layout)."""
    p2p = workspace_bytes // 4 // 256 * 256
    return (workspace_bytes - p2p) // 2 // 256 * 256


def _classify(program: object, heap: Sequence[int] | None, nbytes: int) -> tuple[int, int]:
    """(bytes over NVLink, bytes through local memory) of rank 0's program: an operand in a
    peer's workspace (a Slot of another rank) or in a peer's symmetric heap is remote."""
    link = local = 0
    for ins in program.instructions:
        if ins[0] == SYNC:
            continue
        operands = [ins[3], ins[4]] if ins[0] == COPY else [ins[3], *ins[4]]
        assert ins[0] in (COPY, REDUCE)
        for r in operands:
            remote = isinstance(r, Slot) and r.peer != 0
            if heap is not None and isinstance(r, Ref):
                remote = any(base <= r.addr < base + nbytes for base in heap[1:])
            link += ins[1] if remote else 0
            local += 0 if remote else ins[1]
    return link, local


def count(algo: str, nbytes: int, world: int, half_bytes: int, symmetric: bool = False) -> dict:
    """Syncs, NVLink bytes and local bytes of rank 0's program for an all_reduce of ``nbytes``
    (float32), and the grid of its launch. ``symmetric``: the tensor is in the symmetric heap
    (gpucomm.empty), so two-shot runs in place (the other algorithms take the halves anyway)."""
    tensor = torch.empty(max(1, nbytes // 4), dtype=torch.float32)  # never touched: no memory used
    heap = None
    if symmetric:
        # Rank 0's heap starts at the tensor; the peers' heaps at addresses nothing else uses
        # (nothing is launched: they only tell rank 0's operands from the peers').
        span = _round_up(tensor.numel() * 4, 1 << 30) * 4
        heap = [tensor.data_ptr() + p * span for p in range(world)]
    b = Builder(0, world, half_bytes, "all_reduce", (algo, nbytes), args=[Region.of(tensor)], heap=heap)
    if symmetric and algo == "twoshot":
        allreduce.twoshot_symmetric(b, tensor, ReduceOp.SUM)
    else:
        allreduce.run(algo, b, tensor, ReduceOp.SUM)
    program = b.finish()
    link, local = _classify(program, heap, tensor.numel() * 4)
    # Copies from the caller's tensor into this rank's own slot: each is a dependency of the SYNC
    # after it, which the formula lets overlap with the links (what serial_us does not).
    copy_in = sum(i[1] for i in program.instructions if i[0] == COPY and isinstance(i[3], Slot) and not isinstance(i[4], Slot))
    extent = program.extent or max((i[1] for i in program.instructions if i[0] != SYNC), default=0)
    return {
        "syncs": program.syncs,
        "link_bytes": link,
        "local_bytes": local,
        "copy_in_bytes": copy_in,
        "grid": launch_channels(max(extent, program.grid_bytes), MAX_CHANNELS),
    }


def count_multimem(nbytes: int, world: int, symmetric: bool) -> dict:
    """What the multimem all_reduce (kernels/triton/multimem.py) costs rank 0, by construction:
    a barrier, then ``multimem.ld_reduce`` and ``multimem.st`` of its 1/P of the tensor, then a
    barrier. Each GPU's NVLink carries, in its busier direction, the switch's reads of its copy
    for every rank's load-reduce (n) plus its own 1/P stored once (the switch fans it out):
    (1 + 1/P) n, against 2 (P-1)/P n for two-shot or ring. An ordinary tensor is first copied
    into the multicast-bound workspace and the result copied back (4 n through local memory)."""
    return {
        "syncs": 2,
        "link_bytes": nbytes + nbytes // world,
        "local_bytes": 0 if symmetric else 4 * nbytes,
        "copy_in_bytes": 0 if symmetric else nbytes,
        "copy_out_bytes": 0 if symmetric else nbytes,
        "grid": launch_channels(max(1, nbytes // world), MAX_CHANNELS),
        "multimem": True,
    }


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def predict(counts: dict, p: argparse.Namespace) -> float:
    """Device microseconds of one call (the module docstring's formula; multimem traffic at
    ``multimem_gbs`` instead of ``link_gbs``)."""
    share = min(1.0, counts["grid"] / p.saturating_grid)
    link_gbs = p.multimem_gbs if counts.get("multimem") else p.link_gbs
    link_us = counts["link_bytes"] / (link_gbs * 1e3 * share)
    hbm_us = (counts["local_bytes"] + counts["link_bytes"]) / (p.hbm_gbs * 1e3)
    return p.launch_us + counts["syncs"] * p.sync_us + max(link_us, hbm_us)


def serial_us(counts: dict, p: argparse.Namespace) -> float:
    """:func:`predict` with the copies into the workspace (and, for multimem, back out) not
    overlapped with anything: each read and written once through HBM before its SYNC."""
    copies = counts.get("copy_in_bytes", 0) + counts.get("copy_out_bytes", 0)
    return predict(counts, p) + 2 * copies / (p.hbm_gbs * 1e3)


def busbw(nbytes: int, us: float, world: int) -> float:
    """NCCL's bus bandwidth of an all_reduce, GB/s: bytes / time * 2 (P - 1) / P."""
    return nbytes / (us * 1e3) * 2 * (world - 1) / world


def table(args: argparse.Namespace) -> list[dict]:
    """Every size's prediction: each algorithm on ordinary tensors, two-shot in place and the
    multimem path on symmetric ones, and what gpucomm's table picks in each mode."""
    half = _half_bytes(args.workspace_bytes)
    rows = []
    for nbytes in SIZES:
        row: dict = {"bytes": nbytes}
        for algo in ALGOS:
            c = count(algo, nbytes, args.world, half)
            c["device_us"] = round(predict(c, args), 2)
            c["serial_us"] = round(serial_us(c, args), 2)
            row[algo] = c
        c = count("twoshot", nbytes, args.world, half, symmetric=True)
        c["device_us"] = c["serial_us"] = round(predict(c, args), 2)
        row["twoshot_symmetric"] = c
        for mode in ("ordinary", "symmetric"):
            c = count_multimem(nbytes, args.world, symmetric=mode == "symmetric")
            c["device_us"] = round(predict(c, args), 2)
            c["serial_us"] = round(serial_us(c, args), 2)
            row[f"multimem_{mode}"] = c
        # What a call gets in each mode: the contract-keeping algorithms (one-shot, two-shot; on
        # a symmetric tensor two-shot runs in place), then the same with multimem allowed.
        modes = {
            "ordinary": ("oneshot", "twoshot"),
            "symmetric": ("oneshot", "twoshot", "twoshot_symmetric"),
            "ordinary_multimem": ("oneshot", "twoshot", "multimem_ordinary"),
            "symmetric_multimem": ("oneshot", "twoshot", "twoshot_symmetric", "multimem_symmetric"),
        }
        for mode, candidates in modes.items():
            best = min(candidates, key=lambda a: row[a]["device_us"])
            us = row[best]["device_us"]
            slow = min(candidates, key=lambda a: row[a]["serial_us"])
            row[mode] = {"algo": best, "device_us": us, "eager_us": round(us + args.host_us, 2),
                         "busbw_gbs": round(busbw(nbytes, us, args.world), 1),
                         "serial_algo": slow, "serial_us": row[slow]["serial_us"],
                         "serial_busbw_gbs": round(busbw(nbytes, row[slow]["serial_us"], args.world), 1)}
        rows.append(row)
    return rows


def sync_share(workspace_bytes: int, args: argparse.Namespace, nbytes: int = 1 << 30) -> float:
    """The share of a two-shot all_reduce of ``nbytes`` on an ordinary tensor that its SYNCs
    take, with a workspace of ``workspace_bytes`` (how the default workspace size is chosen)."""
    c = count("twoshot", nbytes, args.world, _half_bytes(workspace_bytes))
    return c["syncs"] * args.sync_us / predict(c, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--workspace-bytes", type=int, default=DEFAULT_WORKSPACE_BYTES["cuda"])
    parser.add_argument("--launch-us", type=float, default=3.0, help="assumed: kernel start to first instruction")
    parser.add_argument("--sync-us", type=float, default=3.0, help="assumed: one flag round trip over NVLink")
    parser.add_argument("--link-gbs", type=float, default=450.0, help="published: NVLink 4, per direction per H100")
    parser.add_argument(
        "--multimem-gbs", type=float, default=309.0,
        help="assumed: NVLink bytes per second per direction of multimem traffic, as NCCL's NVLS reaches it "
        "(its published 480 GB/s bus at 1 GiB moves (1 + 1/8) GiB per direction in 3.91 ms)",
    )
    parser.add_argument("--hbm-gbs", type=float, default=3000.0, help="published anchor: one H100's copy bandwidth")
    parser.add_argument("--saturating-grid", type=int, default=16, help="assumed: channels that saturate NVLink")
    parser.add_argument("--host-us", type=float, default=10.0, help="host Python per eager call (issue 22's goal)")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args(argv)
    rows = table(args)
    modes = ("ordinary", "symmetric", "ordinary_multimem", "symmetric_multimem")
    print(f"{'bytes':>12} " + " ".join(f"{a:>8}" for a in ALGOS) + f" {'2shot-sym':>9} {'mm-ord':>8} {'mm-sym':>8}  "
          + "  ".join(f"{m + ' us (GB/s)':>26}" for m in modes))
    for row in rows:
        cells = " ".join(f"{row[a]['device_us']:8.1f}" for a in ALGOS)
        extra = f" {row['twoshot_symmetric']['device_us']:9.1f} {row['multimem_ordinary']['device_us']:8.1f} {row['multimem_symmetric']['device_us']:8.1f}"
        picks = "  ".join(f"{row[m]['device_us']:>10.1f} ({row[m]['busbw_gbs']:6.1f}) {row[m]['algo'][:7]:>7}" for m in modes)
        print(f"{row['bytes']:>12} {cells}{extra}  {picks}")
    shares = {ws: round(sync_share(ws, args), 3) for ws in WORKSPACE_SIZES}
    print("share of a 1 GiB two-shot all_reduce (ordinary tensor) spent in SYNCs, by GPUCOMM_WORKSPACE_BYTES:")
    print("  " + ", ".join(f"{ws >> 20} MiB: {share:.1%}" for ws, share in shares.items()))
    if args.json:
        write_json(args.json, run_settings(args, half_bytes=_half_bytes(args.workspace_bytes)), rows=rows, sync_share=shares)
    return 0


if __name__ == "__main__":
    sys.exit(main())
