"""A program of no instructions is launched nowhere: an all_to_all's delivery on a rank that sends
and receives nothing (while its peer receives), and every rank's delivery of an all_to_all of
nothing. Only SYNCs advance the epochs, so the ranks still agree on every call after it: the
collectives that follow complete with the right results, in both program-kernel families
(Triton's interpreter, the CUDA C++ kernels built for the host), across real processes over the
shared-memory workspace. The executor refuses to make a table of no instructions
(``instruction_rows``), so a launch of one fails here rather than running a placeholder row.
"""

from __future__ import annotations

import pytest
from spawn import run_ranks

FAMILIES = {
    "triton": {"TRITON_INTERPRET": "1"},
    "cuda": {"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64"},
}


def _ranks(rank: int, world_size: int, kernels: str) -> dict:
    import torch

    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels=kernels, workspace_bytes="48K", timeout=30)
    got = {}
    # Rank 0 sends 3 elements to rank 1 and receives nothing: its delivery has no move and no SYNC.
    if rank == 0:
        out, inp, out_splits, in_splits = torch.full((0,), -1.0), torch.arange(3.0) + 1, [0, 0], [0, 3]
    else:
        out, inp, out_splits, in_splits = torch.full((3,), -1.0), torch.empty(0), [3, 0], [0, 0]
    gpucomm.all_to_all_single(out, inp, out_splits, in_splits)
    got["one_sided"] = out.tolist()
    nothing = torch.empty(0)
    gpucomm.all_to_all_single(nothing, torch.empty(0), [0, 0], [0, 0])
    # The calls after them: a mismatch of epochs would raise (or time out) here.
    x = torch.arange(5.0) * (rank + 1)
    gpucomm.all_reduce(x)
    got["all_reduce"] = x.tolist()
    out = torch.full((4,), -1.0)
    gpucomm.all_to_all_single(out, torch.arange(4.0) + 10 * rank)
    got["all_to_all"] = out.tolist()
    gpucomm.destroy_process_group()
    return got


@pytest.mark.parametrize("kernels", list(FAMILIES))
def test_a_rank_without_moves_launches_nothing_and_the_ranks_still_agree(kernels: str) -> None:
    got = run_ranks(_ranks, 2, kernels, env=FAMILIES[kernels], timeout=300)
    assert got[0]["one_sided"] == [] and got[1]["one_sided"] == [1.0, 2.0, 3.0]
    for g in got:
        assert g["all_reduce"] == [0.0, 3.0, 6.0, 9.0, 12.0]
    assert got[0]["all_to_all"] == [0.0, 1.0, 10.0, 11.0]
    assert got[1]["all_to_all"] == [2.0, 3.0, 12.0, 13.0]
