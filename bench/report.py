"""The text report, laid out as nccl-tests prints it: a header, one row per size, a footer."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["table_header", "table_row", "table_footer", "avg_busbw"]

VARIANTS = ("out_of_place", "in_place")


def table_header() -> str:
    return "\n".join(
        [
            f"#{'':>71}out-of-place{'':>23}in-place",
            f"# {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}"
            + f"  {'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}" * 2,
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


def table_row(row: dict) -> str:
    return (
        f"  {row['size']:>10}  {row['count']:>12}  {row['type']:>8}  {row['redop']:>6}  {row['root']:>6}"
        + "".join(_variant(row[v]) for v in VARIANTS)
    )


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
