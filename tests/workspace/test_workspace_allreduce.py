"""all_reduce on the workspace path (shm transport), with the torch reference kernels (every op ×
dtype × size) and with the real Triton kernels under TRITON_INTERPRET=1 (every op × dtype, the
larger sizes in turn), one-shot and two-shot, world sizes 2-4, including tensors many times larger
than the workspace.
"""

from __future__ import annotations

import random
import time

import pytest
from spawn import RanksFailed, run_ranks

WORKSPACE = "16K"  # 6 KiB per half (mailboxes take a quarter): 4099 fp64 elements take 6 pieces
LARGE = 20011  # elements: 20 to 80 pieces depending on the dtype


def _allreduce_matrix(
    rank: int, world_size: int, seed: int, kernels: str, algo: str
) -> tuple[list[str], list[str], list[str]]:
    import io
    import logging

    from collective_matrix import DTYPES, OPS, Matrix

    import gpucomm

    stream = io.StringIO()
    gpucomm.init_process_group(
        transport="shm", kernels=kernels, algo=algo, workspace_bytes=WORKSPACE, debug="INFO", timeout=60
    )
    logging.getLogger("gpucomm").addHandler(logging.StreamHandler(stream))
    m = Matrix(seed)
    # The torch kernels: every dtype x op at every size, and a LARGE case per dtype. The Triton
    # kernel under the interpreter costs about 0.1 s per piece, so it runs every dtype x op at 1
    # and 7 elements, 4099 (a few pieces) with the ops in turn, and LARGE (many pieces) in fp32 and
    # fp16 only: 15 and 18 s at 3 and 4 ranks two-shot, against 37 and 42 s for the whole matrix.
    lean = kernels != "torch"
    for i, dtype in enumerate(DTYPES):
        for op in OPS:
            for n in (1, 7) if lean else (1, 7, 4099):
                m.all_reduce(n, dtype, op)
        if lean:
            m.all_reduce(4099, dtype, OPS[i % len(OPS)])
        if not lean or i < 2:
            m.all_reduce(LARGE, dtype, OPS[m.case % len(OPS)])
    m.all_reduce(4099, DTYPES[0], OPS[0], async_op=True)
    gpucomm.destroy_process_group()
    return m.failures, m.digests, stream.getvalue().splitlines()


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_on_the_workspace(world_size: int, algo: str, kernels: str) -> None:
    seed = random.randrange(1 << 30)
    env = {"TRITON_INTERPRET": "1"} if kernels == "triton" else {}
    results = run_ranks(_allreduce_matrix, world_size, seed, kernels, algo, env=env, timeout=600)
    failures = [f for fails, _, _ in results for f in fails]
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:40])
    digests = [d for _, d, _ in results]
    for r, d in enumerate(digests):
        assert d == digests[0], f"seed {seed}: rank {r}'s results differ bitwise from rank 0's"
    log = results[0][2]
    expected = f"path=workspace algo={algo} transport=shm kernels={kernels}"
    served = [line for line in log if line.startswith("gpucomm[rank 0]: all_reduce")]
    assert served and all(expected in line for line in served), served[:3]


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_written_with_the_device_api(world_size: int) -> None:
    # gpucomm.language's first user: the one-shot of kernels/triton/oneshot.py, the same matrix.
    test_all_reduce_on_the_workspace(world_size, "oneshot_lang", "triton")


def _die_or_wait(rank: int, world_size: int, victim: int, timeout: float) -> float:
    import os
    import signal

    import torch

    import gpucomm

    gpucomm.init_process_group(transport="shm", kernels="torch", timeout=timeout)
    t = torch.ones(1000)
    gpucomm.all_reduce(t)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        gpucomm.all_reduce(t)
    except gpucomm.CommTimeoutError as err:
        assert err.missing == [victim] and err.op == "all_reduce" and err.rank == rank, str(err)
        # Its process is gone: said as lost, not waited for (gpucomm.reliability.lost).
        assert isinstance(err, gpucomm.PeerLostError) and f"lost rank(s) [{victim}]" in str(err), str(err)
        # The communicator is broken now: the next call fails at once with the cause.
        try:
            gpucomm.all_reduce(t)
        except gpucomm.CommBrokenError as broken:
            assert f"lost rank(s) [{victim}]" in str(broken)
        else:
            raise AssertionError("a call after the timeout did not raise CommBrokenError")
        gpucomm.destroy_process_group()
        return time.monotonic() - start
    raise AssertionError("all_reduce with a dead peer returned")


def test_killed_rank_makes_the_others_raise_within_the_timeout() -> None:
    timeout = 8.0
    results = run_ranks(_die_or_wait, 3, 1, timeout, allow_exit=(1,), timeout=120)
    for rank, elapsed in enumerate(results):
        if rank != 1:  # a lost peer is seen from 0.5 s into the wait on (gpucomm.reliability.lost)
            assert 0.4 <= elapsed <= timeout / 2, f"rank {rank} raised after {elapsed:.1f} s"


def test_a_missing_rank_is_reported_not_hung() -> None:
    with pytest.raises(RanksFailed):
        run_ranks(_die_or_wait, 2, 1, 2.0, timeout=60)
