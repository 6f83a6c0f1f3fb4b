"""DDP on gpucomm: the ``gpucomm`` torch.distributed backend and the hooks of ``gpucomm.ddp``.

One spawn per world size trains the same model several ways (gloo as the reference, the gpucomm
backend, gloo + each gpucomm hook) on the workspace path emulated on CPU (``shm`` + torch
kernels), and the tests below read what the ranks sent back. tests/gpu/test_ddp_gpu.py runs the
same tests on CUDA with its own ``runs`` fixture.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from ddp_runs import (  # noqa: F401 (the tests shared with tests/gpu/test_ddp_gpu.py, collected here too)
    STEPS,
    Bucket,
    Runs,
    bucket_bytes,
    check_script_under_torchrun,
    exact_avg,
    gradients,
    log_lines,
    on_workspace,
    rel_diff,
    same_on_all_ranks,
    test_allreduce_hook_matches_gloo,
    test_backend_serves_ddp_setup_and_gradient_buckets,
    test_backend_trains_like_gloo,
    test_compressed_hooks_beat_torch,
    test_compressed_hooks_train,
    train,
    training_runs,
)
from spawn import run_ranks

ENV = {
    "GPUCOMM_TRANSPORT": "shm",
    "GPUCOMM_KERNELS": "torch",
    "GPUCOMM_WORKSPACE_BYTES": "256K",
    "GPUCOMM_DEBUG": "INFO",
    "GPUCOMM_TIMEOUT": "60",
    "OMP_NUM_THREADS": "1",
}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"{p}ranks")
def runs(request, tmp_path_factory) -> Runs:
    seed = random.randrange(1 << 20)
    tmp = tmp_path_factory.mktemp(f"ddp{request.param}")
    return Runs(
        seed, run_ranks(training_runs, request.param, str(tmp), seed, "cpu", env=ENV, timeout=240), "shm", "torch"
    )


def test_torch_collectives_through_backend(runs) -> None:
    results = runs.results
    failed = {(rank, name) for rank, r in enumerate(results) for name, ok in r["api"].items() if not ok}
    assert not failed, f"wrong results (rank, collective): {sorted(failed)}"


def test_hooks_on_any_torch_group(runs) -> None:
    """DDP on a gloo group, no gpucomm.init_process_group: GpucommState(model.process_group)
    builds the Communicator from that group, and training matches plain gloo."""
    seed, results = runs.seed, runs.results
    assert same_on_all_ranks(results, "hook_torch_group")
    diff = rel_diff(results[0]["hook_torch_group"]["params"], results[0]["gloo"]["params"])
    assert diff < 1e-6, f"seed {seed}: hook on a torch group vs gloo: relative difference {diff:.3g}"
    rank0 = results[0]["hook_torch_group_log"]
    buckets = [
        line
        for line in rank0
        if line.startswith(f"gpucomm[rank 0]: all_reduce bytes={bucket_bytes(results)} dtype=float32 op=AVG")
    ]
    assert len(buckets) == STEPS and all(on_workspace(runs, line) for line in buckets), rank0


def test_hook_state_is_checked(runs) -> None:
    results = runs.results
    assert "state must be a gpucomm.ddp.GpucommState or None, got str" in results[0]["bad_state"]
    assert "gpucomm.ddp.GpucommState: no process group to reduce over" in results[0]["no_group"]


# -- the Triton kernels, under the interpreter ------------------------------------------------
def _triton(rank: int, world_size: int, tmp: str, seed: int) -> dict:
    import torch.distributed as dist

    import gpucomm  # noqa: F401  registers the "gpucomm" backend
    from gpucomm import ddp

    lines = log_lines()
    cpu = torch.device("cpu")
    reference = train(rank, world_size, "gloo", f"file://{tmp}/gloo", seed, cpu, steps=3)
    dist.destroy_process_group()
    res = train(rank, world_size, "gpucomm", f"file://{tmp}/backend", seed, cpu, steps=3)
    grads = gradients(seed, world_size)
    # the bf16 hook on the backend's own Communicator: Triton's bf16 rounding is done by hand
    # under the interpreter, so check it bitwise
    out = grads[rank].clone()
    ddp.bf16_compress_hook(ddp.GpucommState(dist.group.WORLD), Bucket(out)).wait()  # the backend lends its Communicator
    dist.destroy_process_group()
    return {
        "diff": rel_diff(res["params"], reference["params"]),
        "bf16_exact": torch.equal(out, exact_avg(grads, torch.bfloat16)),
        "log": list(lines),
    }


def test_backend_on_triton_kernels_under_interpreter(tmp_path) -> None:
    seed = random.randrange(1 << 20)
    env = {**ENV, "TRITON_INTERPRET": "1", "GPUCOMM_KERNELS": "triton"}
    results = run_ranks(_triton, 2, str(tmp_path), seed, env=env, timeout=240)
    for rank, r in enumerate(results):
        assert r["diff"] < 1e-6, f"seed {seed} rank {rank}: gpucomm backend (triton) vs gloo: {r['diff']:.3g}"
        assert r["bf16_exact"], f"seed {seed} rank {rank}: bf16 hook on Triton kernels is not round(sum_fp32 / P)"
        assert any(
            re.search(r": all_reduce .* path=workspace .*transport=shm kernels=triton$", line) for line in r["log"]
        ), r["log"][:8]


def test_ddp_train_script_under_torchrun(tmp_path) -> None:
    check_script_under_torchrun(tmp_path, "cpu", {k: v for k, v in ENV.items() if k != "GPUCOMM_DEBUG"})
