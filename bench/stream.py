"""Rank 0's report of one collective, printed row by row as each size finishes (as nccl-tests does).

One backend: nccl-tests' table as it prints it. Several backends: one table whose rows, one per
backend at each size, end with the backend's name, so that the columns nccl-tests' parsers read
keep their places; then each backend's footer and the comparison table. A backend that fails
says so on the line after the row where it stopped.
"""

from __future__ import annotations

from collections.abc import Sequence

from .progress import emit
from .report import comparison_table, table_footer, table_header, table_row

__all__ = ["TableStream", "combo_label"]


def combo_label(dtype: str, op: str, reducing: bool) -> str:
    """``  float sum`` after the collective's name where -d all or -o all vary them ("" otherwise)."""
    return f"    {dtype}{' ' + op if reducing else ''}"


class TableStream:
    """Print one collective's table as its rows arrive; ``label`` follows the collective's name."""

    def __init__(self, bar, collective: str, label: str = "") -> None:
        self.bar, self.collective, self.label = bar, collective, label
        self.names: list[str] = []

    def start(self, names: Sequence[str], skipped: Sequence[dict]) -> None:
        """Each skipped table's reason, then the table head of the backends in ``names``."""
        for table in skipped:
            emit(self.bar, f"#\n# {self._title(table['backend'])}\n# skipped: {table['skipped']}\n#")
        self.names = list(names)
        if not self.names:
            return
        many = len(self.names) > 1
        title = self._title(", ".join(self.names), many)
        suffix = " (last column)" if many else ""
        emit(self.bar, f"#\n# {title}{suffix}\n#\n{table_header(backend_column=many)}")

    def row(self, name: str, row: dict) -> None:
        emit(self.bar, table_row(row, backend=name if len(self.names) > 1 else None))

    def error(self, name: str, text: str) -> None:
        emit(self.bar, f"# ERROR: {name}: {text}" if len(self.names) > 1 else f"# ERROR: {text}")

    def end(self, tables: Sequence[dict], rounds: int) -> None:
        """Each measured backend's footer, then the backends side by side where two or more have rows."""
        ran = [t for t in tables if t["backend"] in self.names]
        for table in ran:
            prefix = f"#  {table['backend']}:\n" if len(self.names) > 1 else ""
            emit(self.bar, prefix + table_footer(table["rows"], table["wrong"]))
        measured = [t for t in ran if t["rows"]]
        if len(measured) >= 2:
            emit(self.bar, comparison_table(self.collective + self.label, measured, rounds))

    def _title(self, backends: str, many: bool = False) -> str:
        return f"Collective test: {self.collective}{self.label}    backend{'s' * many}: {backends}"
