"""Ranks that call something else at the same step raise CommMismatchError, however alike the calls look.

Two kinds of look-alike calls that the workspace once ran silently (docs/reliability.md, "Mismatched
calls are caught"):

- **Dtypes that stage alike**: int8, uint8, int16 and uint16 are reduced as int32, uint32 as
  int64, float8 as float32, and bool, int8, uint8 and the 16-bit ints move as uint8 views. The
  workspace compared the staged form, so int8 against uint8 (and 6 other pairs of 8) ran.
- **Counts whose 20-bit fingerprints collide**: every flag carries 20 bits of a CRC32 of the
  call, and a CRC is linear: 18882 and 102440 fp32 elements (2 ranks, SUM) carry the same bits,
  and so do thousands of other pairs. The identity words beside each flag (the call's exact
  dtype and count, and 48 more bits of a hash) tell them apart.

Each case runs on the shared-memory workspace with the torch kernels, with the Triton program
kernel under the interpreter, and with the CUDA C++ program kernel built for the host
(``GPUCOMM_CUDA_EMULATE=1``); the dtype pairs on gloo too, which always raised.
"""

from __future__ import annotations

import pytest
from spawn import run_ranks

PATHS = {
    "gloo": {"transport": "gloo"},
    "shm": {"transport": "shm", "kernels": "torch"},
    "triton": {"transport": "shm", "kernels": "triton", "channels": 2},
    "cuda": {"transport": "shm", "kernels": "cuda", "channels": 2},
}
ENV = {
    "triton": {"TRITON_INTERPRET": "1"},
    "cuda": {"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64"},  # the CUDA C++ kernels, host-built
}

# (collective, rank 0's dtype, rank 1's dtype): every pair stages alike on the workspace.
DTYPE_PAIRS = [
    ("all_reduce", "float8_e4m3fn", "float32"),  # float8 is reduced in float32
    ("all_reduce", "int8", "uint8"),  # both in int32
    ("all_reduce", "int16", "int32"),
    ("all_reduce", "uint32", "int64"),  # uint32 in int64
    ("broadcast", "int8", "uint8"),  # both move as uint8 views
    ("broadcast", "bool", "uint8"),
    ("all_gather", "int16", "uint16"),
    ("all_gather_into_tensor", "float8_e5m2", "int8"),
]


def _dtype_pair(rank: int, world_size: int, knobs: dict, pairs: list) -> list[tuple[str, bool, bool]]:
    import torch

    import gpucomm

    results = []
    for fn, *dtypes in pairs:
        dtype = getattr(torch, dtypes[rank])
        gpucomm.init_process_group(timeout=20, **knobs)
        t = torch.ones(10).to(dtype)
        before = t.clone()
        raised = False
        try:
            if fn == "all_reduce":
                gpucomm.all_reduce(t)
            elif fn == "broadcast":
                gpucomm.broadcast(t, src=0)
            elif fn == "all_gather":
                gpucomm.all_gather([torch.empty_like(t) for _ in range(world_size)], t)
            else:
                gpucomm.all_gather_into_tensor(torch.empty(10 * world_size, dtype=dtype), t)
        except gpucomm.CommMismatchError:
            raised = True
        gpucomm.destroy_process_group()
        untouched = torch.equal(t.view(torch.uint8), before.view(torch.uint8))
        results.append((f"{fn} {dtypes[0]}/{dtypes[1]}", raised, untouched))
    return results


@pytest.mark.parametrize("path", sorted(PATHS))
def test_dtypes_that_stage_alike_raise_on_every_rank(path: str) -> None:
    per_rank = run_ranks(_dtype_pair, 2, PATHS[path], DTYPE_PAIRS, timeout=300, env=ENV.get(path))
    for rank, results in enumerate(per_rank):
        silent = [name for name, raised, _ in results if not raised]
        assert not silent, f"{path}, rank {rank}: no CommMismatchError for {silent}"
        written = [name for name, _, untouched in results if not untouched]
        assert not written, f"{path}, rank {rank}: the caller's tensor was written for {written}"


def _colliding_counts(limit: int, forced: str = "auto") -> list[tuple[int, int]]:
    """Pairs of fp32 SUM all_reduce counts below ``limit`` whose flags carry the same 20-bit
    fingerprint on a 2-rank shared-memory workspace (the algorithm, ``forced`` or the one
    ``auto`` picks, is part of it)."""
    import torch

    from gpucomm.algorithms import select
    from gpucomm.ops.program import fingerprint

    first: dict[int, int] = {}
    pairs = []
    for n in range(1, limit):
        algo = select.choose("all_reduce", 4 * n, 2, "shm", "auto") if forced == "auto" else forced
        fp = fingerprint("all_reduce", (torch.float32, n, "SUM", algo), None)
        if fp in first:
            pairs.append((first[fp], n))
        else:
            first[fp] = n
    return pairs


def test_counts_whose_fingerprints_collide_have_different_identities() -> None:
    import torch

    from gpucomm.algorithms import select
    from gpucomm.ops.program import identity

    pairs = _colliding_counts(200_000)
    assert len(pairs) > 1000  # the 20 bits alone: thousands of look-alikes
    for a, b in pairs:
        ids = [
            identity(
                "all_reduce", (torch.float32, n, "SUM", select.choose("all_reduce", 4 * n, 2, "shm", "auto")), None
            )
            for n in (a, b)
        ]
        assert ids[0] != ids[1] and ids[0][0] != ids[1][0], (a, b)  # the exact word alone differs


def _count_pairs(rank: int, world_size: int, knobs: dict, pairs: list) -> list[tuple[tuple, bool, bool]]:
    import torch

    import gpucomm

    results = []
    for pair in pairs:
        gpucomm.init_process_group(timeout=20, **knobs, **({"algo": pair[2]} if len(pair) > 2 else {}))
        t = torch.full((pair[rank],), float(rank + 1))
        raised = False
        try:
            gpucomm.all_reduce(t)
        except gpucomm.CommMismatchError:
            raised = True
        gpucomm.destroy_process_group()
        results.append((tuple(pair), raised, bool((t == rank + 1).all())))
    return results


@pytest.mark.parametrize("path", ["shm", "triton", "cuda"])
def test_counts_whose_fingerprints_collide_raise_on_every_rank(path: str) -> None:
    """The issue's pair, and the first colliding pairs above 20 Ki, 40 Ki and 63 Ki elements."""
    pairs = _colliding_counts(110_000)
    sweep = [(18882, 102440), *(next((a, b) for a, b in pairs if b >= low) for low in (20_000, 40_000, 63_000))]
    assert len(set(sweep)) == 4
    if path in ("triton", "cuda"):  # the small kernel's SYNC too (on a GPU it serves up to 64 KiB)
        small = _colliding_counts(60_000, "oneshot_small")
        sweep += [small[0] + ("oneshot_small",)]
    assert (18882, 102440) in pairs  # they still collide in 20 bits: the identity words tell them apart
    per_rank = run_ranks(_count_pairs, 2, PATHS[path], sweep, timeout=300, env=ENV.get(path))
    for rank, results in enumerate(per_rank):
        silent = [pair for pair, raised, _ in results if not raised]
        assert not silent, f"{path}, rank {rank}: no CommMismatchError for counts {silent}"
        written = [pair for pair, _, untouched in results if not untouched]
        assert not written, f"{path}, rank {rank}: the caller's tensor was written for counts {written}"
