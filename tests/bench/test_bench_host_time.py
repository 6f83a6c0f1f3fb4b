"""bench/host_time.py's device path on the driver double: each JSON entry says how the kernel was
launched beside its median, and the JIT dispatch's entry, which cannot run without a CUDA device,
says so and quotes published figures instead of a measurement."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpucomm.toolchain import native


@pytest.mark.skipif(native.load("launch") is None, reason="gpucomm's launcher cannot be built here (no C compiler)")
def test_host_time_says_which_launch_each_figure_is(tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the JIT entry would be measured by bench/gpu_latency.py")
    out = tmp_path / "host_time.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpucomm._bench.host_time",
            "--paths",
            "device",
            "--launch",
            "bound",
            "jit",
            "--calls",
            "50",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    bound, jit = json.loads(out.read_text())["results"]
    assert bound["launch"] == "bound" and bound["median_us"] > 0 and bound["launches_per_call"] == 1
    assert jit["launch"] == "jit" and jit["median_us"] is None and "needs a CUDA device" in jit["not_measured"]
    assert jit["published_us"]["tritonbench PR 669"] == 13.2
