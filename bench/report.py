"""The text report, laid out as nccl-tests prints it: a header, one row per size, a footer."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["table_header", "table_row", "table_footer", "avg_busbw", "comparison_table"]

VARIANTS = ("out_of_place", "in_place")


def table_header(backend_column: bool = False) -> str:
    """nccl-tests' column heads; ``backend_column`` adds a last one (rows of several backends)."""
    last = "  backend" if backend_column else ""
    return "\n".join(
        [
            f"#{'':>71}out-of-place{'':>23}in-place",
            f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}"
            + f"  {'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}" * 2
            + last,
            f"# {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}"
            + f"  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}" * 2,
        ]
    )


def _time(us: float) -> str:
    # nccl-tests' precision: fewer decimals as the number grows, so the column stays 7 wide.
    if us >= 10000:
        return f"{us:7.0f}"
    if us >= 100:
        return f"{us:7.1f}"
    return f"{us:7.2f}"


def _bw(gbps: float) -> str:
    # nccl-tests prints 2 decimals; below 1 GB/s (CPU runs) 4 decimals still fit the 6 columns
    # and keep small bandwidths from all reading 0.00.
    return f"{gbps:6.2f}" if gbps >= 1 else f"{gbps:6.4f}"


def _variant(cell: dict | None) -> str:
    if cell is None:
        return f"  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>6}"
    wrong = "N/A" if cell["wrong"] is None else str(cell["wrong"])
    return f"  {_time(cell['time_us'])}  {_bw(cell['algbw'])}  {_bw(cell['busbw'])}  {wrong:>6}"


def table_row(row: dict, backend: str | None = None) -> str:
    """One size's row; ``backend`` (where several share the table) as the last column."""
    line = f"  {row['size']:>10}  {row['count']:>12}  {row['type']:>8}  {row['redop']:>6}  {row['root']:>6}"
    line += "".join(_variant(row[v]) for v in VARIANTS)
    return line if backend is None else f"{line}  {backend}"


def avg_busbw(rows: Sequence[dict]) -> float | None:
    """Mean of every busbw in the table, both variants (what nccl-tests reports)."""
    values = [row[v]["busbw"] for row in rows for v in VARIANTS if row[v] is not None]
    return sum(values) / len(values) if values else None


def table_footer(rows: Sequence[dict], wrong: int) -> str:
    avg = avg_busbw(rows)
    return "\n".join(
        [
            f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
            f"# Avg bus bandwidth    : {'N/A' if avg is None else f'{avg:.6g}'}",
            "#",
        ]
    )


_SPREAD_WIDTH = 25  # "median [min-max]" with three 7-wide times


def _spread(cell: dict | None) -> str:
    if cell is None:
        return f"{'N/A':>{_SPREAD_WIDTH}}"
    low, high = _time(cell["time_min_us"]).strip(), _time(cell["time_max_us"]).strip()
    return f"{_time(cell['time_us'])} [{low}-{high}]".rjust(_SPREAD_WIDTH)


def _ratio(first: dict | None, other: dict | None, width: int) -> str:
    if first is None or other is None:
        return f"{'N/A':>{width}}"
    return f"{first['time_us'] / other['time_us']:{width}.2f}"


def comparison_table(collective: str, tables: Sequence[dict], rounds: int) -> str:
    """Backends side by side for one collective.

    Each one's median time with its spread over rounds, and the first backend's time over each
    other's (below 1: the first is faster).
    """
    names = [t["backend"] for t in tables]
    labels = [f"{names[0]}/{n}" for n in names[1:]]
    widths = [max(len(label), 6) for label in labels]
    block = sum(_SPREAD_WIDTH + 2 for _ in names) + sum(w + 2 for w in widths)
    columns = "".join(f"  {n:>{_SPREAD_WIDTH}}" for n in names) + "".join(
        f"  {label:>{w}}" for label, w in zip(labels, widths)
    )
    lines = [
        "#",
        f"# Comparison: {collective}    time (us): median [min-max] over {rounds} round{'s' * (rounds != 1)}"
        f"    ratio: {names[0]}'s time / the other's (below 1: {names[0]} is faster)",
        "#",
        f"# {'':>10}" + "".join(f"{v.replace('_', '-'):>{block}}" for v in VARIANTS),
        f"# {'size':>10}" + columns * len(VARIANTS),
        f"# {'(B)':>10}",
    ]
    by_size = [{row["size"]: row for row in t["rows"]} for t in tables]
    for size in sorted({size for rows in by_size for size in rows}):
        line = f"  {size:>10}"
        for variant in VARIANTS:
            cells = [rows[size][variant] if size in rows else None for rows in by_size]
            line += "".join(f"  {_spread(c)}" for c in cells)
            line += "".join(f"  {_ratio(cells[0], c, w)}" for c, w in zip(cells[1:], widths))
        lines.append(line)
    lines.append("#")
    return "\n".join(lines)
