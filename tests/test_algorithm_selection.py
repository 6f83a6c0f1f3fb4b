"""The selection table, GPUCOMM_ALGO overrides, and the binary heap of the tree algorithms."""

from __future__ import annotations

import pytest

from gpucomm.algorithms import select
from gpucomm.algorithms.tree import Heap

KIB, MIB = 1 << 10, 1 << 20


@pytest.mark.parametrize(
    ("fn", "nbytes", "world_size", "expected"),
    [
        ("all_reduce", 4 * KIB, 4, "oneshot"),
        ("all_reduce", select.ONESHOT_MAX_BYTES, 4, "oneshot"),
        ("all_reduce", select.ONESHOT_MAX_BYTES + 4, 4, "twoshot"),
        ("all_reduce", 64 * MIB, 2, "twoshot"),
        ("all_reduce", 64 * MIB, 8, "ring"),
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
    assert select.choose(fn, nbytes, world_size, "cuda_ipc", "auto") == expected


def test_one_name_applies_where_it_serves() -> None:
    assert select.choose("all_reduce", 1, 4, "shm", "ring") == "ring"
    assert select.choose("all_gather", 1, 4, "shm", "ring") == "ring"
    assert select.choose("broadcast", 1, 4, "shm", "ring") == "direct"  # ring does not serve it
    assert select.choose("barrier", 0, 4, "shm", "tree") == "direct"
    assert select.choose("reduce", 1, 4, "shm", "tree") == "tree"


def test_family_pairs() -> None:
    knob = "all_reduce=tree,all_gather=ring"
    assert select.choose("all_reduce", 64 * MIB, 4, "shm", knob) == "tree"
    assert select.choose("all_gather_into_tensor", 1, 4, "shm", knob) == "ring"  # same family as all_gather
    assert select.choose("broadcast", 1, 4, "shm", knob) == "direct"  # not named: the table decides
    with pytest.raises(ValueError, match=r"GPUCOMM_ALGO=gather=ring names ring, which does not serve gather"):
        select.choose("gather", 1, 4, "shm", "gather=ring")
    mixed = "ring,reduce_scatter_tensor=direct"  # a bare name for the rest; a collective's name for its family
    assert select.choose("all_reduce", 1, 4, "shm", mixed) == "ring"
    assert select.choose("reduce_scatter", 1, 4, "shm", mixed) == "direct"
    assert select.choose("broadcast", 1, 4, "shm", mixed) == "direct"
    with pytest.raises(ValueError, match=r"names 'allreduce', which is not a collective"):
        select.choose("all_reduce", 1, 4, "shm", "allreduce=ring")


def test_hierarchical_serves_all_reduce_only() -> None:
    assert select.choose("all_reduce", 1, 4, "hierarchical", "auto") == "hierarchical"
    assert select.choose("all_reduce", 1, 4, "hierarchical", "oneshot") == "hierarchical"
    for fn in ("broadcast", "all_gather", "send", "barrier"):
        assert select.choose(fn, 1, 4, "hierarchical", "auto") is None
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
