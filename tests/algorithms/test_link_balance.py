"""No GPU's outbound link serves everyone at once: the programs of every rank at 8 ranks, for every
collective and the algorithm ``auto`` picks on GPUs, from 4 KiB to 1 GiB.

A *round* is the run of instructions between two SYNCs; a rank's *step* k is its k-th instruction
in the round. Every channel of a rank runs a round's instructions in the same order, so step k of
every rank is what the links carry together (bench/links.py). For every round and step, the
busiest outbound link carries at most 1.25 x the mean of all ranks' outbound bytes in that step.
Where one root gathers (reduce's last round, gather), one rank reads per step and its inbound link
carries what the owner's outbound link does: there the bar is the busiest inbound link, not the
mean (the outbound end is not the narrow one).

Set aside, each with a check of its own:

- scatter: the data exists only at the root, so the root's outbound link carries (P - 1)/P of it
  whatever the order; the check is that no byte leaves the root twice;
- broadcast and reduce up to gpucomm.algorithms.select.ROOTED_DIRECT_MAX_BYTES_GPU: direct, where
  the model (both ends charged) has the one-link form ahead of the spread one; the check is that
  the model says so at each of those sizes;
- the spread broadcast's first data round: only the root holds anything yet (every rank reads its
  slice of the first piece from the root); the check is that it is the only one and moves one
  piece.

The programs are built, never run (bench/programs.py), on the GPU's 24 MiB halves.
"""

from __future__ import annotations

import argparse

import pytest

from gpucomm._bench import links, programs

P = 8
HALF = 24 << 20  # the GPU's default 64 MiB workspace (gpucomm.config)
SIZES = [1 << k for k in range(12, 31)]  # 4 KiB to 1 GiB
BAR = 1.25
MODEL = argparse.Namespace(launch_us=3.0, sync_us=3.0, link_gbs=0.82 * 450, hbm_gbs=3000.0, saturating_grid=16)
GATHERING = ("reduce", "gather")  # one root reads per step: the inbound bar


def _walks(collective: str, nbytes: int, algo: str | None = None, symmetric: bool = False) -> list:
    out = []
    for rank in range(P):
        program, heap = programs.build(collective, nbytes, P, rank, HALF, algo=algo, symmetric_tensor=symmetric)
        out.append(links.rounds(program, P, rank, heap))
    return out


def _worst(collective: str, walks: list) -> list[dict]:
    """The steps over the bar."""
    rows = links.outbound_balance(walks)
    if collective in GATHERING:
        return [r for r in rows if r["ratio"] > BAR]
    return [r for r in rows if r["busiest"] > BAR * r["mean"]]


def _direct_rooted(collective: str, nbytes: int) -> bool:
    return collective in ("broadcast", "reduce") and programs.pick(collective, nbytes, P) == "direct"


@pytest.mark.parametrize("symmetric", [False, True], ids=["ordinary", "symmetric"])
@pytest.mark.parametrize("collective", [c for c in programs.COLLECTIVES if c != "scatter"])
def test_no_outbound_link_carries_more_than_its_share_in_any_step(collective: str, symmetric: bool) -> None:
    if symmetric and collective in ("all_to_all", "gather"):
        pytest.skip("no in-place form: the same programs as on ordinary tensors")
    for nbytes in SIZES:
        if _direct_rooted(collective, nbytes):
            continue  # test_direct_rooted_collectives_run_only_where_the_model_has_them_ahead
        over = _worst(collective, _walks(collective, nbytes, symmetric=symmetric))
        if collective == "broadcast" and programs.pick(collective, nbytes, P) == "spread":
            # The first data round (round 1: round 0 stages the first piece at the root).
            assert {r["round"] for r in over} <= {1}, (nbytes, over[:3])
            assert sum(r["busiest"] for r in over) <= HALF, (nbytes, over[:3])
            continue
        assert not over, f"{collective} {nbytes} bytes ({programs.pick(collective, nbytes, P)}): {over[:3]}"


def test_direct_rooted_collectives_run_only_where_the_model_has_them_ahead() -> None:
    for collective in ("broadcast", "reduce"):
        for nbytes in SIZES:
            if _direct_rooted(collective, nbytes):
                direct = links.program_us(_walks(collective, nbytes, "direct"), MODEL)
                spread = links.program_us(_walks(collective, nbytes, "spread"), MODEL)
                assert direct < spread, (collective, nbytes, direct, spread)


def test_no_byte_of_a_scatter_leaves_the_root_twice() -> None:
    for nbytes in SIZES:
        walks = _walks("scatter", nbytes)
        sent = sum(b for _, rounds in walks for r in rounds for step in r["steps"] for (k, o), b in step if k == "out")
        assert sent == (P - 1) * max(1, nbytes // 4 // P) * 4, nbytes


def test_every_rank_in_rank_order_fails_the_bar() -> None:
    """The measure can fail: two-shot's all-gather with every rank reading rank p in step p (the
    per-peer order before Builder.spread) is over it at every size two-shot serves."""
    from gpucomm.ops.program import Builder

    spread = Builder.spread
    try:
        Builder.spread = Builder.peers
        over = _worst("all_reduce", _walks("all_reduce", 64 << 20))
    finally:
        Builder.spread = spread
    assert over and max(r["busiest"] / r["mean"] for r in over) > 6
