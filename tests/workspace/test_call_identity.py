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

Each case runs on the shared-memory workspace with the torch kernels, and with the Triton
program kernel under the interpreter; the dtype pairs on gloo too, which always raised.
"""

from __future__ import annotations

import pytest
from spawn import run_ranks

PATHS = {
    "gloo": {"transport": "gloo"},
    "shm": {"transport": "shm", "kernels": "torch"},
    "triton": {"transport": "shm", "kernels": "triton", "channels": 2},
}
ENV = {"triton": {"TRITON_INTERPRET": "1"}}

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
