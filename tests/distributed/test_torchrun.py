"""A torch.distributed script with ``import gpucomm as dist`` runs unchanged under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from spawn import free_port

SCRIPT = Path(__file__).parents[1] / "support" / "scripts" / "torch_api_script.py"


def _torchrun(
    script: Path, nproc: int, results: Path, env_extra: dict[str, str] | None = None
) -> tuple[dict[int, str], str]:
    """Per-rank results of ``script`` under torchrun, and what the ranks wrote to stderr."""
    results.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESULT_DIR": str(results), **(env_extra or {})}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {int(p.stem.removeprefix("rank")): p.read_text() for p in results.glob("rank*.json")}
    assert sorted(found) == list(range(nproc)), proc.stdout[-3000:]
    return found, proc.stderr


def test_script_runs_unchanged_and_matches_torch_distributed(tmp_path: Path) -> None:
    with_torch = tmp_path / "with_torch.py"
    with_torch.write_text(SCRIPT.read_text().replace("import gpucomm as dist", "import torch.distributed as dist"))
    assert _torchrun(SCRIPT, 3, tmp_path / "gpucomm")[0] == _torchrun(with_torch, 3, tmp_path / "torch")[0]


EMULATION = {"TRITON_INTERPRET": "1", "GPUCOMM_TRANSPORT": "shm", "GPUCOMM_DEBUG": "INFO"}


@pytest.mark.parametrize(
    ("nproc", "kernels", "algo"),
    [
        (3, "triton", "auto"),
        (4, "torch", "oneshot"),
        (4, "torch", "twoshot"),
        (4, "torch", "ring"),
        (4, "torch", "tree"),
    ],
)
def test_script_on_the_emulated_workspace_path(tmp_path: Path, nproc: int, kernels: str, algo: str) -> None:
    """The same script on gpucomm's own kernels over shared memory: same results, no gloo."""
    with_torch = tmp_path / "with_torch.py"
    with_torch.write_text(SCRIPT.read_text().replace("import gpucomm as dist", "import torch.distributed as dist"))
    env = {**EMULATION, "GPUCOMM_KERNELS": kernels, "GPUCOMM_ALGO": algo}
    got, log = _torchrun(SCRIPT, nproc, tmp_path / "gpucomm", env)
    expected, _ = _torchrun(with_torch, nproc, tmp_path / "torch")
    assert got == expected
    calls = [line for line in log.splitlines() if line.startswith("gpucomm[rank")]
    assert len(calls) >= 15 * nproc, calls[:5]
    assert all("path=workspace" in line and f"kernels={kernels}" in line for line in calls), [
        c for c in calls if "path=workspace" not in c
    ][:5]
    if algo != "auto":
        assert all(f"algo={algo}" in line for line in calls if ": all_reduce " in line)


def test_script_on_the_cuda_kernels_built_for_the_host(tmp_path: Path) -> None:
    """GPUCOMM_CUDA_EMULATE=1 GPUCOMM_KERNELS=cuda GPUCOMM_TRANSPORT=shm: every collective of the script
    on the CUDA C++ kernels built for the host, the same results as on the Triton kernels under the
    interpreter and as torch.distributed's."""
    with_torch = tmp_path / "with_torch.py"
    with_torch.write_text(SCRIPT.read_text().replace("import gpucomm as dist", "import torch.distributed as dist"))
    cuda = {**EMULATION, "GPUCOMM_CUDA_EMULATE": "1", "GPUCOMM_CUDA_EMULATE_THREADS": "64", "GPUCOMM_KERNELS": "cuda"}
    got, log = _torchrun(SCRIPT, 3, tmp_path / "cuda", cuda)
    triton, _ = _torchrun(SCRIPT, 3, tmp_path / "triton", {**EMULATION, "GPUCOMM_KERNELS": "triton"})
    expected, _ = _torchrun(with_torch, 3, tmp_path / "torch")
    assert got == triton == expected
    calls = [line for line in log.splitlines() if line.startswith("gpucomm[rank")]
    assert len(calls) >= 15 * 3, calls[:5]
    off = [c for c in calls if "path=workspace" not in c or not c.endswith("kernels=cuda (emulated)")]
    assert not off, off[:5]
