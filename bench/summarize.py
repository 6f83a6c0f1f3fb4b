"""Markdown tables from ``gpucomm-bench --json`` files: each collective, gpucomm against a peer.

One row per size: gpucomm's time and the peer's, each the median over rounds with its spread
(min-max over rounds), and their ratio (below 1: gpucomm is faster), out-of-place and in-place.

Example::

    python -m gpucomm._bench.summarize ar2.json ag2.json --peer gloo
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main", "table"]


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _us(cell: dict) -> str:
    low, high = cell.get("time_min_us", cell["time_us"]), cell.get("time_max_us", cell["time_us"])
    return f"{cell['time_us']:.4g} [{low:.4g}-{high:.4g}]"


def _op(table: dict) -> str:
    redop = table["rows"][0].get("redop", "none") if table["rows"] else "none"
    return "" if redop == "none" else f" {redop}"


def table(data: dict, peer: str) -> str:
    """The markdown comparison of every collective in one bench JSON."""
    settings = data["settings"]
    by_key = {(t["backend"], t["collective"]): t for t in data["tables"]}
    lines = []
    for (backend, collective), ours in by_key.items():
        theirs = by_key.get((peer, collective))
        if backend != "gpucomm" or theirs is None:
            continue
        if theirs.get("skipped") and not theirs["rows"]:  # e.g. NCCL refused the layout: say why
            lines += [f"**{collective}**: {peer} {theirs['skipped']}", ""]
            continue
        lines += [
            f"**{collective}**, {settings['world_size']} ranks, {settings['dtype']}{_op(ours)}, "
            f"{len(ours['rows'][0]['out_of_place'].get('round_time_us', [0]))} rounds "
            "(us: median [min-max] over rounds)",
            "",
            f"| size | gpucomm | {peer} | ratio | gpucomm in-place | {peer} in-place | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
        peer_rows = {row["size"]: row for row in theirs["rows"]}
        for row in ours["rows"]:
            other = peer_rows.get(row["size"])
            if other is None:
                continue
            cells = [_size(row["size"])]
            for variant in ("out_of_place", "in_place"):
                mine, their = row[variant], other[variant]
                if mine is None or their is None:
                    cells += ["", "", ""]
                    continue
                cells += [_us(mine), _us(their), f"{mine['time_us'] / their['time_us']:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpucomm._bench.summarize", description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="gpucomm-bench --json outputs")
    parser.add_argument("--peer", default="gloo", help="the backend gpucomm is compared with")
    args = parser.parse_args(argv)
    for path in args.files:
        with open(path) as f:
            print(table(json.load(f), args.peer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
