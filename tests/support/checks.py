"""Checks that a rank collects and returns instead of raising at the first (so that one run of
many ranks reports every failure of every rank)."""

from __future__ import annotations


class Checks:
    """One rank's checks: ``expect`` counts each and keeps the failed ones, named with the rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures: list[str] = []
        self.count = 0

    def expect(self, ok: bool, what: str) -> None:
        self.count += 1
        if not ok:
            self.failures.append(f"rank {self.rank}: {what}")


def outcome(call) -> str:
    """What ``call()`` ended with: "ok", or the error's type and message."""
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the test reads every kind
        return f"{type(err).__name__}: {err}"
    return "ok"
