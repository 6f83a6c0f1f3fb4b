"""A torch.distributed script with ``import gpucomm as dist`` runs unchanged under torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from spawn import free_port

SCRIPT = Path(__file__).parent / "scripts" / "torch_api_script.py"


def _torchrun(script: Path, nproc: int, env_extra: dict[str, str] | None = None) -> dict[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}", str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {int(m.group(1)): m.group(2) for m in re.finditer(r"^RESULT (\d+) (.*)$", proc.stdout, re.M)}
    assert sorted(results) == list(range(nproc)), proc.stdout
    return results


def test_script_runs_unchanged_and_matches_torch_distributed(tmp_path: Path) -> None:
    with_torch = tmp_path / "with_torch.py"
    with_torch.write_text(SCRIPT.read_text().replace("import gpucomm as dist", "import torch.distributed as dist"))
    assert _torchrun(SCRIPT, 3) == _torchrun(with_torch, 3)
