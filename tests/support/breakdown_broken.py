"""A rank of ``python -m gpucomm._bench.breakdown`` whose "full" all_reduce program leaves its REDUCEs
out: the bench's check must catch it (tests/bench/test_breakdown.py). A module of its own, so that
the bench's spawned ranks can import it."""

from __future__ import annotations

from gpucomm._bench import breakdown_programs as bp
from gpucomm._bench.breakdown_rank import rank_main


def _variants_without_the_reduce(program):  # noqa: ANN001, ANN202
    made = bp.variants(program)
    return {**made, "full": made["no_reduce"]}


def broken_rank(rank: int, world: int, port: int, args, results) -> None:  # noqa: ANN001
    """bench/breakdown_rank.py's rank, its "full" row running the program without its REDUCEs."""
    rank_main(rank, world, port, args, results, variants=_variants_without_the_reduce)
