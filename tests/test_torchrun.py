"""A torch.distributed script with ``import gpucomm as dist`` runs unchanged under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from spawn import free_port

SCRIPT = Path(__file__).parent / "scripts" / "torch_api_script.py"


def _torchrun(script: Path, nproc: int, results: Path) -> dict[int, str]:
    results.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESULT_DIR": str(results)}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = {int(p.stem.removeprefix("rank")): p.read_text() for p in results.glob("rank*.json")}
    assert sorted(found) == list(range(nproc)), proc.stdout[-3000:]
    return found


def test_script_runs_unchanged_and_matches_torch_distributed(tmp_path: Path) -> None:
    with_torch = tmp_path / "with_torch.py"
    with_torch.write_text(SCRIPT.read_text().replace("import gpucomm as dist", "import torch.distributed as dist"))
    assert _torchrun(SCRIPT, 3, tmp_path / "gpucomm") == _torchrun(with_torch, 3, tmp_path / "torch")
