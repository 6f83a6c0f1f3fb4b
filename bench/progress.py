"""The benchmark's progress bar on stderr, and report lines that keep it whole."""

from __future__ import annotations

import sys

__all__ = ["show_bar", "progress_bar", "emit"]


def show_bar() -> bool:
    """Whether to show a progress bar: only where stdout and stderr are both terminals."""
    # Where either goes to a log (CI, `2>&1`, `| tee`), the bar's redraws would land between the
    # table rows.
    return sys.stdout.isatty() and sys.stderr.isatty()


class _NoBar:
    """What the report needs of a progress bar, where none is shown."""

    disable = True

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool):  # a tqdm bar, or a _NoBar
    """A bar on stderr counting ``total`` rounds; one that shows nothing where not ``enabled``."""
    # tqdm is optional (the `bench` extra): a GPU machine that installs gpucomm with --no-deps and
    # has no network may lack it, and a bar that is off needs nothing of it.
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, file=sys.stderr, leave=False, unit="round")


def emit(bar, text: str) -> None:
    """Print a report line; through the bar where it is shown, so that the bar stays whole."""
    if bar.disable:
        print(text, flush=True)
    else:
        bar.write(text, file=sys.stdout)
