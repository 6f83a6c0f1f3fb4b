"""The model behind docs/performance.md (bench/model.py): what gpucomm's all_reduce programs move
at 8 ranks against the textbook costs, how it times a round with both ends of every link charged
(bench/links.py), its rows at both link rates, and the thresholds of ``auto`` taken from it."""

from __future__ import annotations

import json
import pathlib

import pytest

from gpucomm._bench import links, model
from gpucomm._bench.model import count
from gpucomm.algorithms import select

HALF = 3 << 20  # a small workspace's half: pieces at sizes the tests can afford
ARGS = model.parser().parse_args([])
ARGS.link_gbs = ARGS.link_shares[0] * model.NVLINK_GBS
RESULTS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results" / "2026-11-29-model" / "model_8xh100.json"


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
        # Through HBM: the reduce's P sources and its result, then 7 slices read and written.
        assert inplace["local_bytes"] == (P + 1) * nbytes // P + 2 * (P - 1) * nbytes // P
    assert count("twoshot", 1 << 30, P, HALF, symmetric=True)["grid"] == 32


def _step(reader: int, owner: int, nbytes: int) -> tuple:
    load = {("hbm", reader): 2 * nbytes, ("in", reader): nbytes, ("out", owner): nbytes}
    return tuple(sorted(load.items()))


def _caps(world: int, link: float, hbm: float) -> tuple:
    caps = []
    for r in range(world):
        caps += [(("out", r), link), (("in", r), link), (("hbm", r), hbm)]
    return tuple(caps)


def test_a_round_charges_both_ends_of_every_link_max_min_fairly() -> None:
    """By hand: 4 ranks, 1 MB each read from one peer, links of 100 bytes/us, HBM 1000. Every rank
    reading its own next peer: each link end carries one reader, 10000 us. Every rank reading rank
    0 (rank 0 its own next peer): rank 0's outbound link serves three readers at a third each, 30000
    us, while the inbound links could each take the full rate. Two readers of rank 0 and two spread:
    the spread ones finish at 10000 us, the two sharing rank 0's link at 20000 us."""
    caps = _caps(4, 100.0, 1000.0)
    mb = 10**6
    spread = tuple((_step(r, (r + 1) % 4, mb),) for r in range(4))
    assert links.round_us(spread, caps) == pytest.approx(10000.0)
    one_owner = tuple((_step(r, 0 if r else 1, mb),) for r in range(4))
    assert links.round_us(one_owner, caps) == pytest.approx(30000.0)
    mixed = ((_step(0, 1, mb),), (_step(1, 0, mb),), (_step(2, 0, mb),), (_step(3, 2, mb),))
    assert links.round_us(mixed, caps) == pytest.approx(20000.0)
    # HBM bounds a local step: 2 MB through 1000 bytes/us.
    local = ((((("hbm", 0), 2 * mb),),),) + ((),) * 3
    assert links.round_us(local, caps) == pytest.approx(2000.0)


def test_every_rank_starting_at_its_own_next_peer_halves_a_4_mib_call() -> None:
    """All-reduce two-shot at 4 MiB on 8 ranks, 0.82 x 450 GB/s both ends: 32 us with every rank
    starting at its own next peer (the figure docs/performance.md quotes), against 62 us in rank
    order, where rank p's outbound link serves the seven others in step p."""
    from gpucomm.ops.program import Builder

    spread = model.count("twoshot", 4 << 20, 8, 24 << 20, p=ARGS)["device_us"]
    order = Builder.spread
    try:
        Builder.spread = Builder.peers
        ranked = model.count("twoshot", 4 << 20, 8, 24 << 20, p=ARGS)["device_us"]
    finally:
        Builder.spread = order
    assert spread == pytest.approx(31.7, abs=0.5)
    assert ranked > 1.8 * spread


def test_the_model_runs_at_82_and_57_percent_of_nvlink() -> None:
    assert ARGS.link_shares == [0.82, 0.57]
    rates = {r["link_gbs"] for r in model.rows(ARGS, [8 << 10], others=())}
    assert rates == {round(0.82 * 450, 1), round(0.57 * 450, 1)}


def test_the_gpus_default_workspace_keeps_syncs_under_six_percent_and_is_within_two_percent_of_the_best() -> None:
    """gpucomm.config's choice: with every copy-in but the first carried by a fold, SYNCs are what a
    larger workspace still saves at 1 GiB (64 MiB 5.24 ms, 128 MiB 5.18, 256 MiB 5.16: 1.6%); 64 MiB
    stays the default within 2% of the best, at a quarter of the memory of 256 MiB."""
    from gpucomm.config import DEFAULT_WORKSPACE_BYTES

    chosen = DEFAULT_WORKSPACE_BYTES["cuda"]
    assert model.sync_share(chosen, ARGS) < 0.06
    times = {
        ws: count("twoshot", 1 << 30, 8, model._half_bytes(ws), p=ARGS)["device_us"] for ws in model.WORKSPACE_SIZES
    }
    assert times[chosen] <= 1.02 * min(times.values())


def test_rows_have_the_published_fields_and_auto_marks_what_gpucomm_picks() -> None:
    sizes = [8, 8 << 10, 16 << 10, 512 << 10]
    rows = [r for r in model.rows(ARGS, sizes, others=("broadcast",)) if r["link_gbs"] == round(ARGS.link_gbs, 1)]
    fields = {"collective", "link_gbs", "size_bytes", "world", "tensor", "algo", "auto", "device_us", "busbw_gbps"}
    for r in rows:
        assert set(r) == fields | {"phases"}
        assert r["tensor"] in ("ordinary", "symmetric", "multimem", "captured")
        assert all(set(ph) == {"name", "link_bytes", "hbm_bytes", "syncs"} for ph in r["phases"])
    for nbytes in sizes:
        mine = [r for r in rows if r["size_bytes"] == nbytes and r["collective"] == "all_reduce"]
        picked = [r["algo"] for r in mine if r["tensor"] == "ordinary" and r["auto"]]
        assert picked == [select.choose("all_reduce", nbytes, 8, "cuda_ipc", "auto")]
        assert sum(r["auto"] for r in mine if r["tensor"] == "symmetric") == 1
        assert sum(r["auto"] for r in mine if r["tensor"] == "captured") == 1
        rooted = [r["algo"] for r in rows if r["size_bytes"] == nbytes and r["collective"] == "broadcast" and r["auto"]]
        assert rooted == [select.choose("broadcast", nbytes, 8, "cuda_ipc", "auto")]


@pytest.mark.parametrize("world", range(2, 9))
def test_auto_on_gpus_picks_the_faster_of_one_shot_and_two_shot_in_the_model(world: int) -> None:
    """The thresholds of gpucomm.algorithms.select come from the model: at every size around
    them, auto picks the algorithm the model has ahead."""
    sizes = [1 << k for k in range(3, 23 if world > 2 else 27)]
    for row in model.crossover(ARGS, worlds=[world], sizes=sizes):
        faster = "oneshot" if row["oneshot_us"] < row["twoshot_us"] else "twoshot"
        if faster == "oneshot" and row["size_bytes"] <= select.SMALL_MAX_BYTES:
            faster = select.SMALL  # one-shot's bytes and SYNC in the small-message kernel
        assert select.choose("all_reduce", row["size_bytes"], world, "cuda_ipc", "auto") == faster, row


def test_the_committed_rows_are_what_the_model_gives_now() -> None:
    """docs/performance.md's table comes from the committed JSON: it must be the model's output."""
    committed = json.loads(RESULTS.read_text())
    again = {_key(r): r for r in model.rows(ARGS, [512 << 10, 4 << 20])}
    compared = 0
    for r in committed["rows"]:
        if _key(r) in again:
            assert r == again[_key(r)]
            compared += 1
    assert compared == len(again)


def _key(r: dict) -> tuple:
    return (r["collective"], r["link_gbs"], r["size_bytes"], r["tensor"], r["algo"])


def test_the_docs_table_is_printed_from_the_committed_rows() -> None:
    committed = json.loads(RESULTS.read_text())
    doc = (RESULTS.parents[2] / "performance.md").read_text()
    assert model.markdown(committed["rows"]) in doc


def _uncarried(program):
    """``program`` with every carried COPY run alone, after its REDUCE (as an executor that does not
    fuse them runs it)."""
    import dataclasses

    from gpucomm.ops.program import carried

    instructions = [ins[:5] if carried(ins) else ins for ins in program.instructions]
    return dataclasses.replace(program, instructions=instructions, cache={})


@pytest.mark.parametrize("nbytes", [64 << 20, 1 << 30])
def test_carrying_the_next_copy_in_beside_the_fold_shortens_the_critical_path(nbytes: int) -> None:
    """Pipelined two-shot (more than one piece) folds piece t - 1 carrying
    piece t's copy-in (its P - 1 slices but the rank's own, in two ranges): the same programs with
    those copies run alone after their fold take longer, by about the carried copy-ins' pass through
    HBM (2 bytes per byte copied, at 3 TB/s): P - 1 slices of every piece but the first."""
    from gpucomm.algorithms.allreduce import FIRST_PIECE_SHARE
    from gpucomm.ops.program import carried

    P, half = 8, 24 << 20
    first = half // FIRST_PIECE_SHARE
    fused, alone = [], []
    for rank in range(P):
        program, _ = model.build("twoshot", nbytes, P, rank, half)
        carried_bytes = sum(ins[1] for ins in program.instructions if carried(ins))
        assert carried_bytes == pytest.approx((nbytes - first) * (P - 1) / P, rel=1e-3)
        fused.append(model.walk(program, P, rank))
        alone.append(model.walk(_uncarried(program), P, rank))
    fast, slow = links.program_us(fused, ARGS), links.program_us(alone, ARGS)
    hidden = 2 * (nbytes - first) * (P - 1) / P / (ARGS.hbm_gbs * 1e3)
    assert slow - fast == pytest.approx(hidden, rel=0.05)


def test_many_pieces_take_one_sync_each() -> None:
    """From two pieces on two-shot folds piece t - 1 and gathers piece t - 2 in one round (one piece:
    two SYNCs): pieces + 1 SYNCs (its pieces: a short first one, then the even pieces of the rest), and the
    1 GiB call at 0.82 x 450 GB/s reaches 350 GB/s bus."""
    from gpucomm.ops.program import REDUCE

    half = 24 << 20
    assert count("twoshot", half, 8, half)["syncs"] == 2
    for nbytes in (half + 64, 2 * half, 1 << 30):
        program, _ = model.build("twoshot", nbytes, 8, 0, half)
        pieces = sum(ins[0] == REDUCE for ins in program.instructions)
        assert pieces > -(-nbytes // half) - 1 and program.syncs == pieces + 1
    us = count("twoshot", 1 << 30, 8, half, p=ARGS)["device_us"]
    assert model.busbw(1 << 30, us, 8) >= 350


def test_a_captured_graph_replays_the_in_place_two_shot_where_auto_picks_a_form_of_its_bits() -> None:
    """The captured rows are what gpucomm.workspace.graph_buffers runs: where auto picks one-shot or
    two-shot, the in-place two-shot on the users' tensors (three SYNCs, no copy-in or copy-out, any
    size); where it picks the small path, that path's own row."""
    from gpucomm.workspace.graph_buffers import IN_PLACE_ALGOS

    sizes = [8 << 10, 512 << 10]
    got = model.rows(ARGS, sizes, others=())
    for nbytes in sizes:
        pick = select.choose("all_reduce", nbytes, 8, "cuda_ipc", "auto")
        for rate in {r["link_gbs"] for r in got}:
            mine = {(r["tensor"], r["algo"]): r for r in got if r["size_bytes"] == nbytes and r["link_gbs"] == rate}
            captured = [r for (tensor, _), r in mine.items() if tensor == "captured"]
            assert len(captured) == 1 and captured[0]["auto"]
            if pick in IN_PLACE_ALGOS:
                assert captured[0]["algo"] == "twoshot_inplace"
                assert captured[0]["device_us"] == mine[("symmetric", "twoshot_inplace")]["device_us"]
                names = " ".join(ph["name"] for ph in captured[0]["phases"])
                assert "copy-in" not in names and "copy-out" not in names
                assert sum(ph["syncs"] for ph in captured[0]["phases"]) == 3
            else:
                assert captured[0]["algo"] == pick
                assert captured[0]["device_us"] == mine[("ordinary", pick)]["device_us"]


def test_a_captured_graph_meets_its_rows_at_82_percent_of_nvlink() -> None:
    """Issue rows at 0.82 x 450 GB/s, both ends charged, 8 ranks: a captured graph on an ordinary
    tensor (the in-place two-shot) under 332 us at 64 MiB and at least 360 GB/s bus at 1 GiB."""
    half = 24 << 20
    assert count("twoshot", 64 << 20, 8, half, symmetric=True, p=ARGS)["device_us"] < 332
    us = count("twoshot", 1 << 30, 8, half, symmetric=True, p=ARGS)["device_us"]
    assert model.busbw(1 << 30, us, 8) >= 360


def test_eager_64_mib_is_the_link_bound_and_syncs_plus_the_first_copy_in() -> None:
    """What docs/performance.md says of eager 64 MiB at 0.82 x 450 GB/s: with every step that
    moves no link byte taken out, the program is launch, the link bound 2 (P - 1) / P x 64 MiB and
    five SYNCs (four pieces: a short first one of a quarter half, then three), 336 us; the first
    piece's copy-in (nothing before it to carry it) is the rest: 339.9 us, within the 345 us bar.
    Every later copy-in rides on a fold, and no own slice is copied out of the half."""
    from gpucomm.algorithms.allreduce import FIRST_PIECE_SHARE

    P, nbytes, half = 8, 64 << 20, 24 << 20
    walks = [model.walk(model.build("twoshot", nbytes, P, rank, half)[0], P, rank) for rank in range(P)]
    linked = []
    for grid, rounds in walks:
        kept = [{**r, "steps": [s for s in r["steps"] if any(res != "hbm" for (res, _), _ in s)]} for r in rounds]
        linked.append((grid, kept))
    bound = ARGS.launch_us + 2 * (P - 1) / P * nbytes / (ARGS.link_gbs * 1e3) + 5 * ARGS.sync_us
    assert links.program_us(linked, ARGS) == pytest.approx(bound, abs=1.0)
    total = links.program_us(walks, ARGS)
    exposed = total - links.program_us(linked, ARGS)
    first_copy_in = 2 * (P - 1) / P * (half // FIRST_PIECE_SHARE) / (ARGS.hbm_gbs * 1e3)
    assert exposed == pytest.approx(first_copy_in, rel=0.05)
    assert total <= 345
