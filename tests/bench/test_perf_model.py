"""The model behind docs/performance.md (bench/model.py): what gpucomm's all_reduce programs move
at 8 ranks against the textbook costs, the critical path it reads from them, its rows, and the
thresholds of ``auto`` taken from it."""

from __future__ import annotations

import json
import pathlib

import pytest

from gpucomm._bench import model
from gpucomm._bench.model import count
from gpucomm.algorithms import select

HALF = 3 << 20  # a small workspace's half: pieces at sizes the tests can afford
ARGS = model.parser().parse_args([])
RESULTS = (
    pathlib.Path(__file__).resolve().parents[2]
    / "docs"
    / "results"
    / "2026-11-26-model"
    / "allreduce_8xh100_model.json"
)


@pytest.mark.parametrize("nbytes", [32 << 10, 2 << 20])
def test_each_algorithm_moves_what_its_textbook_cost_says(nbytes: int) -> None:
    P = 8
    oneshot, twoshot, ring = (count(a, nbytes, P, HALF) for a in ("oneshot", "twoshot", "ring"))
    assert (oneshot["syncs"], oneshot["link_bytes"]) == (1, (P - 1) * nbytes)
    assert (twoshot["syncs"], twoshot["link_bytes"]) == (2, 2 * (P - 1) * nbytes // P)
    assert (ring["syncs"], ring["link_bytes"]) == (2 * (P - 1), 2 * (P - 1) * nbytes // P)


def test_small_messages_run_one_channel_and_large_ones_many() -> None:
    assert count("oneshot", 8, 8, HALF)["grid"] == 1
    assert count("twoshot", 1 << 30, 8, HALF)["grid"] == 32
    # 1 GiB in even pieces of at most 3 MiB: one SYNC per piece for one-shot.
    assert count("oneshot", 1 << 30, 8, HALF)["syncs"] == -(-(1 << 30) // HALF)


def test_symmetric_two_shot_moves_the_same_bytes_with_three_syncs_and_no_copy() -> None:
    P = 8
    for nbytes in (32 << 10, 1 << 30):
        inplace = count("twoshot", nbytes, P, HALF, symmetric=True)
        assert inplace["syncs"] == 3
        assert inplace["link_bytes"] == 2 * (P - 1) * nbytes // P
        # Its own slice read and written by the reduce, every other slice written by the gather.
        assert inplace["local_bytes"] == 2 * nbytes // P + (P - 1) * nbytes // P
    assert count("twoshot", 1 << 30, P, HALF, symmetric=True)["grid"] == 32


def test_the_critical_path_is_each_rounds_busiest_channel_plus_its_sync() -> None:
    """512 KiB two-shot at 8 ranks, by hand: 8 channels of 1/16 of the link and of HBM each.
    Copy-in: 64 KiB a channel, read and written locally; reduce: 8 KiB of 8 sources, 7 of
    them a peer's, and the result stored; copy-out: 8 KiB of each of the 8 slices, 7 of them
    read from a peer, one instruction after the other."""
    c = count("twoshot", 512 << 10, 8, 24 << 20, p=ARGS)
    link, hbm = ARGS.link_gbs * 1e3 / 16, ARGS.hbm_gbs * 1e3 / 16  # bytes per us a channel
    kib = 1024
    copy_in = 2 * 64 * kib / hbm
    reduce = max(7 * 8 * kib / link, 9 * 8 * kib / hbm)
    copy_out = 7 * max(8 * kib / link, 2 * 8 * kib / hbm) + 2 * 8 * kib / hbm
    want = ARGS.launch_us + copy_in + ARGS.sync_us + reduce + ARGS.sync_us + copy_out
    assert c["device_us"] == pytest.approx(want, rel=1e-9)
    assert [ph["name"] for ph in c["phases"]] == ["copy-in", "reduce", "copy-out"]
    assert [ph["syncs"] for ph in c["phases"]] == [1, 1, 0]
    assert [max(ph["channel_bytes"]) for ph in c["phases"]] == [128 * kib, 72 * kib, 128 * kib]


def test_the_model_gives_the_link_82_percent_of_nvlink() -> None:
    assert ARGS.link_gbs == pytest.approx(0.82 * 450)


def test_the_gpus_default_workspace_is_the_smallest_whose_syncs_take_under_six_percent() -> None:
    from gpucomm.config import DEFAULT_WORKSPACE_BYTES

    chosen = DEFAULT_WORKSPACE_BYTES["cuda"]
    assert model.sync_share(chosen, ARGS) < 0.06 <= model.sync_share(chosen // 2, ARGS)


def test_rows_have_the_published_fields_and_auto_marks_what_gpucomm_picks() -> None:
    sizes = [8, 8 << 10, 16 << 10, 512 << 10]
    rows = model.rows(ARGS, sizes)
    for r in rows:
        assert set(r) == {"size_bytes", "world", "tensor", "algo", "auto", "device_us", "busbw_gbps", "phases"}
        assert r["tensor"] in ("ordinary", "symmetric", "multimem")
        assert all(set(ph) == {"name", "channel_bytes", "syncs"} for ph in r["phases"])
    for nbytes in sizes:
        picked = [r["algo"] for r in rows if r["size_bytes"] == nbytes and r["tensor"] == "ordinary" and r["auto"]]
        assert picked == [select.choose("all_reduce", nbytes, 8, "cuda_ipc", "auto")]
        assert sum(r["auto"] for r in rows if r["size_bytes"] == nbytes and r["tensor"] == "symmetric") == 1


@pytest.mark.parametrize("world", range(2, 9))
def test_auto_on_gpus_picks_the_faster_of_one_shot_and_two_shot_in_the_model(world: int) -> None:
    """The thresholds of gpucomm.algorithms.select come from the model: at every size around
    them, auto picks the algorithm the model has ahead."""
    limit = select.oneshot_max_bytes(world, "cuda_ipc")
    sizes = [1 << k for k in range(3, 23)] if limit < (1 << 30) else [8, 1 << 20, 64 << 20]
    for row in model.crossover(ARGS, worlds=[world], sizes=sizes):
        faster = "oneshot" if row["oneshot_us"] < row["twoshot_us"] else "twoshot"
        if faster == "oneshot" and row["size_bytes"] <= select.SMALL_MAX_BYTES:
            faster = select.SMALL  # one-shot's bytes and SYNC in the small-message kernel
        assert select.choose("all_reduce", row["size_bytes"], world, "cuda_ipc", "auto") == faster, row


def test_the_committed_rows_are_what_the_model_gives_now() -> None:
    """docs/performance.md's table comes from the committed JSON: it must be the model's output."""
    committed = json.loads(RESULTS.read_text())
    again = {(r["size_bytes"], r["tensor"], r["algo"]): r for r in model.rows(ARGS, [512 << 10, 4 << 20])}
    for r in committed["rows"]:
        key = (r["size_bytes"], r["tensor"], r["algo"])
        if key in again:
            assert r == again[key]


def _unpaired(program):
    """``program`` with every paired COPY run as its two copies, one after the other."""
    import dataclasses

    from gpucomm.ops.program import COPY

    instructions = []
    for ins in program.instructions:
        if ins[0] == COPY and len(ins) == 7:  # (a REDUCE has 7 fields too)
            instructions += [ins[:5], (COPY, ins[1], ins[2], ins[5], ins[6])]
        else:
            instructions.append(ins)
    return dataclasses.replace(program, instructions=instructions, cache={})


@pytest.mark.parametrize("nbytes", [64 << 20, 1 << 30])
def test_copying_the_next_piece_in_beside_the_all_gather_shortens_the_critical_path(nbytes: int) -> None:
    """Two-shot pairs piece k's copy-in with piece k-1's all-gather, slice by slice, wherever
    the two pieces are cut alike (all but the last, which is a little shorter): the same
    programs with the pairs run one copy after the other take longer, by the paired copy-ins'
    pass through HBM (2 bytes per byte copied, at 3 TB/s) beside the P-1 slices read over the
    links (the own slice's pair is local on both sides: nothing to hide behind)."""
    from gpucomm.ops.program import COPY

    P, half = 8, 24 << 20
    pieces = -(-nbytes // half)
    paired, serial = [], []
    for rank in range(P):
        program, _ = model.build("twoshot", nbytes, P, rank, half)
        pairs = sum(1 for ins in program.instructions if ins[0] == COPY and len(ins) == 7)
        assert pairs == P * (pieces - 2)
        paired.append(model.walk(program, P, rank))
        serial.append(model.walk(_unpaired(program), P, rank))
    fast, slow = model.critical_path(paired, ARGS)[0], model.critical_path(serial, ARGS)[0]
    hidden = 2 * nbytes * (pieces - 2) / pieces * (P - 1) / P / (ARGS.hbm_gbs * 1e3)
    assert slow - fast == pytest.approx(hidden, rel=0.02)
