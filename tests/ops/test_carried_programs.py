"""A REDUCE with a second destination (STORE_ALSO) and COPYs flagged CARRIED, one process, both
program kernels on CPU: Triton's under the interpreter and the CUDA C++ one built for the host
(64 threads a block). The cases and their checks are tests/support/carried_programs.py's, the very
code tests/gpu/test_program_kernels.py runs on a GPU: every byte of every destination against
TorchKernels, run as the host executor runs the program (fold, second store, each carried copy
alone, in order). Each family runs in a worker of its own (the interpreter must be on before triton
is imported), which reports a verdict per case.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest
from carried_programs import CASES, VECTORS_PER_SOURCE

THREADS = 64  # the host build's block size: the vector body covers 2 KiB a source, so "body" sizes stay small
FAMILIES = {
    "triton": {"TRITON_INTERPRET": "1"},
    "cuda": {"GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": str(THREADS)},
}
COMMON_CUH = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "cuda" / "common.cuh"


def test_the_cases_count_the_vector_body_the_kernel_has() -> None:
    found = re.findall(r"constexpr int VECTORS_PER_SOURCE = (\d+);", COMMON_CUH.read_text())
    assert found == [str(VECTORS_PER_SOURCE)], found


def _worker(family: str, seed: int) -> dict[str, str]:
    import torch
    from carried_programs import run_case

    from gpucomm.ops import get_kernels

    kernels = get_kernels(family, torch.device("cpu"))
    if getattr(kernels, "threads", THREADS) != THREADS:
        raise RuntimeError(f"test_carried_programs worker: {family} kernels of {kernels.threads} threads")
    return {
        name: run_case(kernels, torch.device("cpu"), case, seed + i, THREADS)
        for i, (name, case) in enumerate(CASES.items())
    }


@pytest.fixture(scope="module")
def verdicts() -> dict[str, dict[str, str]]:
    seed = random.randrange(1 << 30)
    out = {}
    for family, env in FAMILIES.items():
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", family, str(seed)],
            env=dict(os.environ, **env),
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{family} worker failed (exit {proc.returncode}):\n{proc.stderr[-8000:]}")
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        out[family] = {name: verdict and f"seed {seed}: {verdict}" for name, verdict in got.items()}
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_store_also_and_carried_copies_match_torch_bitwise(verdicts, family: str, case: str) -> None:
    if verdicts[family][case]:
        pytest.fail(verdicts[family][case], pytrace=False)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    print(json.dumps(_worker(sys.argv[2], int(sys.argv[3]))))
