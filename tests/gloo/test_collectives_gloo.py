"""Every primitive × op × dtype × size on CPU tensors through the gloo fallback, world sizes 1-4,
at sizes on both sides of the checked path's thresholds too."""

from __future__ import annotations

import random

import pytest
from spawn import run_ranks


def _matrix(rank: int, world_size: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    import io
    import logging

    import torch
    from collective_matrix import DTYPES, Matrix, run_everything

    import gpucomm
    from gpucomm.gloo.checked import capacity

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    gpucomm.init_process_group(transport="gloo", debug="INFO", timeout=60)
    logging.getLogger("gpucomm").addHandler(handler)
    m = Matrix(seed)
    run_everything(m)
    # Both sides of the checked path's thresholds (gpucomm.gloo.checked): the most elements a
    # slot carries and one more, for all_to_all (whose pairs carry up to n + 2) and the rest.
    for dtype in DTYPES:
        size = torch.empty(0, dtype=dtype).element_size()
        most, most_a2a = capacity("all_reduce", world_size) // size, capacity("all_to_all", world_size) // size - 2
        run_everything(m, sizes=(most_a2a, most_a2a + 1, most, most + 1), dtypes=(dtype,))
    gpucomm.destroy_process_group()
    return m.failures, m.digests, stream.getvalue().splitlines()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_collective_on_gloo(world_size: int) -> None:
    seed = random.randrange(1 << 30)
    results = run_ranks(_matrix, world_size, seed, timeout=300)
    failures = [f for fails, _, _ in results for f in fails]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:40])
    digests = [d for _, d, _ in results]
    assert all(d == digests[0] for d in digests), f"seed {seed}: all_reduce results differ between ranks"
    log = results[0][2]
    assert any(
        line.startswith("gpucomm[rank 0]: all_reduce bytes=16396 dtype=float32") and "path=gloo" in line for line in log
    ), log[:5]
