"""A non-editable wheel install finds every kernel: kernels/ ships inside the package as gpucomm._kernels."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHECK = """
import importlib, importlib.resources, json, sys
sys.path.insert(0, sys.argv[1])
import gpucomm
found = {"gpucomm": gpucomm.__file__, "triton": [], "cuda": []}
for name in sys.argv[2].split(","):
    module = importlib.import_module("gpucomm._kernels.triton." + name)
    found["triton"].append(module.__file__)
cuda = importlib.resources.files("gpucomm._kernels.cuda")
found["cuda"] = sorted(p.name for p in cuda.iterdir() if p.name.endswith((".cu", ".cuh")) and p.read_text())
print(json.dumps(found))
"""


def test_wheel_install_finds_every_kernel(tmp_path: Path) -> None:
    # Built from a copy of the sources: setuptools builds in the source tree, and a build/ folder
    # left there by an earlier build would bring files that no longer exist into the wheel.
    source = tmp_path / "source"
    shutil.copytree(
        REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__")
    )
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(source),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("gpucomm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert not any(n.startswith(("kernels/", "bench/")) for n in names), (
        "kernels/ or bench/ installed as top-level packages"
    )
    # the module torch's import calls (entry point group torch.backends: tests/distributed/test_autoload.py)
    assert "_gpucomm_autoload/__init__.py" in names, names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert (
        "[torch.backends]\ngpucomm = _gpucomm_autoload:register" in zipfile.ZipFile(wheel).read(entry_points).decode()
    )
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )

    triton_modules = sorted(p.stem for p in (REPO / "kernels" / "triton").glob("*.py") if p.stem != "__init__")
    cuda_sources = sorted(p.name for p in (REPO / "kernels" / "cuda").iterdir() if p.suffix in (".cu", ".cuh"))
    out = subprocess.run(
        [sys.executable, "-c", CHECK, str(target), ",".join(triton_modules)],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,  # away from the checkout, so only the installed copy can be found
    )
    import json

    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["gpucomm"].startswith(str(target)), found["gpucomm"]
    assert all(f.startswith(str(target)) for f in found["triton"]) and len(found["triton"]) == len(triton_modules)
    assert found["cuda"] == cuda_sources
