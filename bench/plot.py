"""``--plot FILE.png``: bus bandwidth against message size, one line per backend and variant."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["plot_tables"]

_STYLE = {"out_of_place": "-", "in_place": "--"}


def plot_tables(tables: Sequence[dict], path: str, title: str) -> None:
    """One panel per collective; log-x size, linear busbw (GB/s). ``tables`` as in the JSON."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on benchmark hosts
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(t["collective"] for t in tables))
    backends = list(dict.fromkeys(t["backend"] for t in tables))
    if not names:
        raise ValueError(f"plot_tables: no result tables to plot into {path}")
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for table in (t for t in tables if t["collective"] == name):
            color = f"C{backends.index(table['backend'])}"  # one colour per backend in every panel
            for variant, style in _STYLE.items():
                points = [(r["size"], r[variant]["busbw"]) for r in table["rows"] if r[variant] is not None]
                if points:
                    xs, ys = zip(*points)
                    label = f"{table['backend']} {variant.replace('_', '-')}"
                    ax.plot(xs, ys, style, color=color, marker="o", markersize=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("size (B)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
