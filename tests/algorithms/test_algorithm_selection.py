"""The selection table, GPUCOMM_ALGO overrides, and the binary heap of the tree algorithms."""

from __future__ import annotations

import warnings

import pytest

from gpucomm.algorithms import select
from gpucomm.algorithms.tree import Heap

KIB, MIB = 1 << 10, 1 << 20


@pytest.mark.parametrize(
    ("fn", "nbytes", "world_size", "expected"),
    [
        ("all_reduce", 4 * KIB, 4, "oneshot"),  # the small-message kernel serves CUDA tensors only
        ("all_reduce", select.ONESHOT_MAX_BYTES, 4, "oneshot"),
        ("all_reduce", select.ONESHOT_MAX_BYTES + 4, 4, "twoshot"),
        ("all_reduce", 64 * MIB, 2, "twoshot"),
        ("all_reduce", 64 * MIB, 8, "twoshot"),
        ("all_reduce", 1 * MIB, 8, "twoshot"),
        ("broadcast", 64 * MIB, 16, "direct"),
        ("reduce", 1 * KIB, 16, "direct"),
        ("all_gather_into_tensor", 64 * MIB, 8, "direct"),
        ("reduce_scatter_tensor", 64 * MIB, 8, "direct"),
        ("gather", 1, 3, "direct"),
        ("all_to_all_single", 1, 3, "direct"),
        ("isend", 1, 3, "direct"),
        ("barrier", 0, 5, "direct"),
    ],
)
def test_table(fn: str, nbytes: int, world_size: int, expected: str) -> None:
    assert select.choose(fn, nbytes, world_size, "shm", "auto") == expected


@pytest.mark.parametrize(
    ("nbytes", "world_size", "expected"),
    [
        (8 * KIB, 8, select.SMALL),  # one-shot up to 64 KiB runs in the small-message kernel
        (16 * KIB, 8, "twoshot"),
        (32 * KIB, 4, select.SMALL),
        (64 * KIB, 4, "twoshot"),
        (1 * MIB, 3, "oneshot"),
        (2 * MIB, 3, "twoshot"),
        (select.SMALL_MAX_BYTES, 2, select.SMALL),
        (select.SMALL_MAX_BYTES + 4, 2, "oneshot"),
        (8 * MIB, 2, "oneshot"),
        (16 * MIB, 2, "twoshot"),
        (16 * KIB, 16, "twoshot"),
    ],
)
def test_the_gpu_table_follows_the_model(nbytes: int, world_size: int, expected: str) -> None:
    """On CUDA IPC the one-shot threshold is the model's crossover per world size (the rows
    named beside ONESHOT_MAX_BYTES_GPU; tests/bench/test_perf_model.py checks them against the model)."""
    assert select.choose("all_reduce", nbytes, world_size, "cuda_ipc", "auto") == expected


def test_broadcast_and_reduce_spread_over_the_links_above_the_models_threshold() -> None:
    """On CUDA IPC, direct up to ROOTED_DIRECT_MAX_BYTES_GPU, spread above (the model's rows beside
    it; tests/algorithms/test_link_balance.py checks the model has direct ahead below); the
    shared-memory workspace keeps direct, which no CPU measurement has put behind."""
    for fn in ("broadcast", "reduce"):
        limit = select.ROOTED_DIRECT_MAX_BYTES_GPU[fn]
        assert select.choose(fn, limit, 8, "cuda_ipc", "auto") == "direct"
        assert select.choose(fn, limit + 4, 8, "cuda_ipc", "auto") == "spread"
        assert select.choose(fn, 1 << 30, 8, "shm", "auto") == "direct"


@pytest.mark.parametrize("fn", ["all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"])
def test_auto_keeps_the_deterministic_contract_at_every_size_and_world_size(fn: str) -> None:
    family = select.family_of(fn)
    sizes = sorted({0, 1, *(1 << k for k in range(40)), *((1 << k) + 4 for k in range(40)), select.ONESHOT_MAX_BYTES})
    for world_size in range(1, 33):
        for topology in ("shm", "cuda_ipc"):
            for nbytes in sizes:
                algo = select.choose(fn, nbytes, world_size, topology, "auto")
                assert select.keeps_contract(family, algo), (fn, nbytes, world_size, topology, algo)


@pytest.mark.parametrize(
    ("fn", "knob", "algo"),
    [
        ("all_reduce", "ring", "ring"),
        ("all_reduce", "all_reduce=tree", "tree"),
        ("reduce", "tree", "tree"),
        ("reduce_scatter_tensor", "reduce_scatter=ring", "ring"),
    ],
)
def test_forcing_an_order_changing_algorithm_warns_once(fn: str, knob: str, algo: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own: once per message and place
        for nbytes in (4, 1 << 20, 64 << 20):
            assert select.choose(fn, nbytes, 4, "shm", knob) == algo
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    family = select.family_of(fn)
    assert messages[0].startswith(f"gpucomm.{family}: GPUCOMM_ALGO={knob} forces {algo}, which folds"), messages[0]
    assert "\n" not in messages[0]


def test_forcing_a_contract_keeper_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert select.choose("all_reduce", 1 << 20, 4, "shm", "oneshot") == "oneshot"
        assert select.choose("all_gather", 1 << 20, 4, "shm", "ring") == "ring"  # copies only: no fold
        assert select.choose("reduce", 1 << 20, 4, "shm", "ring") == "direct"


def test_one_name_applies_where_it_serves() -> None:
    with pytest.warns(UserWarning, match="forces ring, which folds partial results in ring order"):
        assert select.choose("all_reduce", 1, 4, "shm", "ring") == "ring"
    assert select.choose("all_gather", 1, 4, "shm", "ring") == "ring"
    assert select.choose("broadcast", 1, 4, "shm", "ring") == "direct"  # ring does not serve it
    assert select.choose("barrier", 0, 4, "shm", "tree") == "direct"
    with pytest.warns(UserWarning, match="forces tree, which folds partial results in tree order"):
        assert select.choose("reduce", 1, 4, "shm", "tree") == "tree"


def test_family_pairs() -> None:
    knob = "all_reduce=tree,all_gather=ring"
    with pytest.warns(UserWarning, match="forces tree"):
        assert select.choose("all_reduce", 64 * MIB, 4, "shm", knob) == "tree"
    assert select.choose("all_gather_into_tensor", 1, 4, "shm", knob) == "ring"  # same family as all_gather
    assert select.choose("broadcast", 1, 4, "shm", knob) == "direct"  # not named: the table decides
    with pytest.raises(ValueError, match=r"GPUCOMM_ALGO=gather=ring names ring, which does not serve gather"):
        select.choose("gather", 1, 4, "shm", "gather=ring")
    mixed = "ring,reduce_scatter_tensor=direct"  # a bare name for the rest; a collective's name for its family
    with pytest.warns(UserWarning, match="forces ring"):
        assert select.choose("all_reduce", 1, 4, "shm", mixed) == "ring"
    assert select.choose("reduce_scatter", 1, 4, "shm", mixed) == "direct"
    assert select.choose("broadcast", 1, 4, "shm", mixed) == "direct"
    with pytest.raises(ValueError, match=r"names 'allreduce', which is not a collective"):
        select.choose("all_reduce", 1, 4, "shm", "allreduce=ring")


def test_hierarchical_serves_every_collective_but_send_and_recv() -> None:
    assert select.choose("all_reduce", 1, 4, "hierarchical", "oneshot") == "hierarchical"
    for fn in select.FAMILIES:
        expected = None if select.family_of(fn) == "p2p" else "hierarchical"
        assert select.choose(fn, 1, 4, "hierarchical", "auto") == expected, fn
    assert select.choose("not_a_collective", 1, 4, "shm", "auto") is None


@pytest.mark.parametrize("world_size", range(1, 18))
def test_heap_is_a_tree(world_size: int) -> None:
    for root in range(world_size):
        heaps = [Heap(world_size, root, r) for r in range(world_size)]
        assert heaps[root].parent is None and heaps[root].depth == 0
        for rank, heap in enumerate(heaps):
            if rank != root:
                parent = heaps[heap.parent]
                assert rank in parent.children and heap.depth == parent.depth + 1
            assert all(heaps[c].parent == rank for c in heap.children) and len(heap.children) <= 2
        assert max(h.depth for h in heaps) == heaps[root].height
        assert sorted(c for h in heaps for c in h.children) == sorted(set(range(world_size)) - {root})
