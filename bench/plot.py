"""``--plot FILE.png``: bus bandwidth and time against message size, per backend and variant.

Two panels per collective, both log-log: busbw above, time per call below. A linear axis flattened
every row below 32 KiB of the 2-core CPU runs into the x axis: in docs/results/2026-11-29-bench-threads
(all_reduce, 2 ranks) busbw reads 0.00005-1.09 GB/s below 32 KiB against up to 3.86 GB/s above; on
log axes each decade of size and of bandwidth gets the same room.
Each backend has one colour in every panel; out-of-place is a solid line with filled circles,
in-place a dashed line with open squares, and the legend's handles are long enough to show the
dashes (matplotlib's default handle holds one dash and reads as solid).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["plot_tables", "figure"]

# variant -> (line style, marker, marker face: None fills with the line's colour)
_STYLE = {"out_of_place": ("-", "o", None), "in_place": ("--", "s", "none")}
_LEGEND_HANDLE = 4.0  # in font sizes: two dashes and a gap of "--" at fontsize 7


def _panel_name(table: dict, several: bool) -> str:
    if not several:
        return table["collective"]
    op = f" {table['op']}" if table.get("op") else ""
    return f"{table['collective']} {table.get('dtype', '')}{op}".rstrip()


def figure(tables: Sequence[dict], title: str):
    """The matplotlib figure of ``tables`` (as in the JSON); callers save or inspect it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on benchmark hosts
    import matplotlib.pyplot as plt

    several = len({(t.get("dtype"), t.get("op")) for t in tables}) > 1  # -d all / -o all
    names = list(dict.fromkeys(_panel_name(t, several) for t in tables))
    backends = list(dict.fromkeys(t["backend"] for t in tables))
    if not names:
        raise ValueError(f"figure: expected at least one result table, got {len(tables)}")
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(2 * rows, cols, figsize=(5.5 * cols, 7 * rows), squeeze=False)
    for k, name in enumerate(names):
        bw_ax, time_ax = axes[2 * (k // cols), k % cols], axes[2 * (k // cols) + 1, k % cols]
        for table in (t for t in tables if _panel_name(t, several) == name):
            color = f"C{backends.index(table['backend'])}"  # one colour per backend in every panel
            for variant, (line, marker, face) in _STYLE.items():
                points = [(r["size"], r[variant]) for r in table["rows"] if r[variant] is not None]
                if not points:
                    continue
                xs = [size for size, _ in points]
                label = f"{table['backend']} {variant.replace('_', '-')}"
                style = {"color": color, "marker": marker, "markersize": 4, "markerfacecolor": face, "label": label}
                bw_ax.plot(xs, [cell["busbw"] for _, cell in points], line, **style)
                time_ax.plot(xs, [cell["time_us"] for _, cell in points], line, **style)
        bw_ax.set_title(name)
        for ax, ylabel in ((bw_ax, "busbw (GB/s)"), (time_ax, "time (us)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("size (B)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize=7, handlelength=_LEGEND_HANDLE)
    for k in range(len(names), rows * cols):
        axes[2 * (k // cols), k % cols].set_visible(False)
        axes[2 * (k // cols) + 1, k % cols].set_visible(False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_tables(tables: Sequence[dict], path: str, title: str) -> None:
    """Save :func:`figure` of ``tables`` to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = figure(tables, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
