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

import torch

from gpucomm.algorithms import allreduce
from gpucomm.channels import MAX_CHANNELS, launch_channels
from gpucomm.config import DEFAULT_WORKSPACE_BYTES
from gpucomm.program import COPY, REDUCE, SYNC, Builder, Slot
from gpucomm.reduce_op import ReduceOp

from .hostinfo import run_settings, write_json

__all__ = ["main", "count", "predict"]

ALGOS = ("oneshot", "twoshot", "ring", "tree")
# 8 B to 1 GiB, a factor of 4 apart (plus 512 B, SGLang's published point, and 1 GiB itself).
SIZES = sorted({8 << (2 * i) for i in range(14)} | {512, 1 << 30})


def _half_bytes(workspace_bytes: int) -> int:
    """The engine's half for a data area of ``workspace_bytes`` (gpucomm.engine's layout)."""
    p2p = workspace_bytes // 4 // 256 * 256
    return (workspace_bytes - p2p) // 2 // 256 * 256


def count(algo: str, nbytes: int, world: int, half_bytes: int) -> dict:
    """Syncs, NVLink bytes and local bytes of rank 0's program for an all_reduce of ``nbytes``
    (float32), and the grid of its launch."""
    tensor = torch.empty(max(1, nbytes // 4), dtype=torch.float32)  # never touched: no memory used
    b = Builder(0, world, half_bytes, "all_reduce", (algo, nbytes))
    allreduce.run(algo, b, tensor, ReduceOp.SUM)
    program = b.finish()
    link = local = 0
    for ins in program.instructions:
        if ins[0] == SYNC:
            continue
        operands = [ins[3], ins[4]] if ins[0] == COPY else [ins[3], *ins[4]]
        assert ins[0] in (COPY, REDUCE)
        for r in operands:
            remote = isinstance(r, Slot) and r.peer != 0
            link += ins[1] if remote else 0
            local += 0 if remote else ins[1]
    extent = program.extent or max((i[1] for i in program.instructions if i[0] != SYNC), default=0)
    return {
        "syncs": program.syncs,
        "link_bytes": link,
        "local_bytes": local,
        "grid": launch_channels(extent, MAX_CHANNELS),
    }


def predict(counts: dict, p: argparse.Namespace) -> float:
    """Device microseconds of one call (the module docstring's formula)."""
    share = min(1.0, counts["grid"] / p.saturating_grid)
    link_us = counts["link_bytes"] / (p.link_gbs * 1e3 * share)
    hbm_us = (counts["local_bytes"] + counts["link_bytes"]) / (p.hbm_gbs * 1e3)
    return p.launch_us + counts["syncs"] * p.sync_us + max(link_us, hbm_us)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--workspace-bytes", type=int, default=DEFAULT_WORKSPACE_BYTES)
    parser.add_argument("--launch-us", type=float, default=3.0, help="assumed: kernel start to first instruction")
    parser.add_argument("--sync-us", type=float, default=3.0, help="assumed: one flag round trip over NVLink")
    parser.add_argument("--link-gbs", type=float, default=450.0, help="published: NVLink 4, per direction per H100")
    parser.add_argument("--hbm-gbs", type=float, default=3000.0, help="published anchor: one H100's copy bandwidth")
    parser.add_argument("--saturating-grid", type=int, default=16, help="assumed: channels that saturate NVLink")
    parser.add_argument("--host-us", type=float, default=10.0, help="host Python per eager call (issue 22's goal)")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args(argv)
    half = _half_bytes(args.workspace_bytes)
    rows = []
    for nbytes in SIZES:
        row = {"bytes": nbytes}
        for algo in ALGOS:
            c = count(algo, nbytes, args.world, half)
            c["device_us"] = round(predict(c, args), 2)
            row[algo] = c
        best = min(ALGOS, key=lambda a: row[a]["device_us"])
        row["best"] = best
        row["eager_us"] = round(row[best]["device_us"] + args.host_us, 2)
        # NCCL's bus bandwidth of an all_reduce: bytes / time * 2 (P - 1) / P.
        row["busbw_gbs"] = round(nbytes / (row[best]["device_us"] * 1e3) * 2 * (args.world - 1) / args.world, 1)
        rows.append(row)
    print(f"{'bytes':>12} " + " ".join(f"{a:>9}" for a in ALGOS) + "  best      eager  busbw GB/s")
    for row in rows:
        cells = " ".join(f"{row[a]['device_us']:9.1f}" for a in ALGOS)
        print(f"{row['bytes']:>12} {cells}  {row['best']:8} {row['eager_us']:7.1f}  {row['busbw_gbs']:8.1f}")
    if args.json:
        write_json(args.json, run_settings(args, half_bytes=half), rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
