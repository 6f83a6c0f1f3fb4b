"""``torch.distributed.init_process_group("gpucomm")`` in a script that never imports gpucomm:
torch's import registers the backend through gpucomm's ``torch.backends`` entry point
(gpucomm/_autoload/, installed as the package _gpucomm_autoload), and the first group imports gpucomm."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys, torch, torch.distributed as dist
assert "gpucomm" not in sys.modules, "gpucomm imported by torch's import"
dist.init_process_group("gpucomm", store=dist.HashStore(), rank=0, world_size=1)
t = torch.ones(3)
dist.all_reduce(t)
print(dist.get_backend(), t.tolist(), type(dist.group.WORLD.communicator).__name__)
dist.destroy_process_group()
"""


def test_the_entry_point_is_in_torch_backends_group() -> None:
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="torch.backends")}
    assert found.get("gpucomm") == "_gpucomm_autoload:register", found


def test_init_process_group_gpucomm_works_without_importing_gpucomm(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=tmp_path, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "gpucomm [1.0, 1.0, 1.0] Communicator", out.stdout
