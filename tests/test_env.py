"""``python -m gpucomm.env`` / ``gpucomm.collect_env()``: the report prints without a process
group, starts nothing, says what each transport needs on this host, and what it says ``auto``
picks is what a communicator made here serves (gpucomm.env re-states Communicator's rule)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

# The collection itself took 0.13 s on the 2-core CI machine (torch's import aside, which every
# gpucomm program pays); the limit is 2 s.
COLLECT_LIMIT_S = 2.0

_CHILD = """
import json, threading
import torch.distributed as dist
import gpucomm
from gpucomm.comm.communicator import Communicator
threads = threading.active_count()
report = gpucomm.collect_env()
started = threading.active_count() - threads
with Communicator(dist.HashStore(), 0, 1) as comm:
    served = comm.paths()["cpu"]
print(json.dumps({"text": str(report), "cpu": report.get("auto picks", "CPU tensors"), "served": served,
                  "started": started, "initialized": dist.is_initialized(), "seconds": report.seconds}))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("GPUCOMM_", "TRITON_INTERPRET", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
    }
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _child(**extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=_clean_env(**extra), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_command_prints_every_section() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpucomm.env"], env=_clean_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    for section in ("versions", "GPUs", "transports", "host code", "auto picks", "knobs set"):
        assert re.search(rf"^{section}$", text, re.M), f"no section {section!r}:\n{text}"
    for row in (
        "gpucomm",
        "torch",
        "triton",
        "cupy",
        "CUDA runtime",
        "CUDA driver",
        "cuda_ipc",
        "shm",
        "gloo",
        "C compiler",
        "CPU tensors",
        "CUDA tensors",
    ):
        assert re.search(rf"^  {re.escape(row)} +\S", text, re.M), f"no row {row!r}:\n{text}"
    seconds = float(re.search(r"collected in ([0-9.]+) s", text).group(1))
    assert seconds < COLLECT_LIMIT_S, text
    assert re.search(r"^  shm +(yes|NO): /dev/shm \d+ MiB, \d+ MiB free", text, re.M), text
    if "torch is a CPU build" in text:
        assert re.search(r"^  cuda_ipc +NO: no CUDA device", text, re.M), text


@pytest.mark.parametrize(
    "knobs",
    [{}, {"GPUCOMM_TRANSPORT": "gloo"}, {"TRITON_INTERPRET": "1"}],
    ids=["auto", "gloo", "interpreter"],
)
def test_auto_picks_what_a_communicator_serves(knobs: dict[str, str]) -> None:
    got = _child(**knobs)
    assert got["cpu"].startswith(got["served"]), (
        f"the report says {got['cpu']!r}, a communicator serves {got['served']!r}"
    )
    assert got["started"] == 0 and not got["initialized"] and got["seconds"] < COLLECT_LIMIT_S, got
    for name, value in knobs.items():
        assert re.search(rf"^  {name} +{value}$", got["text"], re.M), got["text"]


def test_a_bad_knob_is_reported_not_raised() -> None:
    got = subprocess.run(
        [sys.executable, "-m", "gpucomm.env"],
        env=_clean_env(GPUCOMM_ALGO="fastest"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    assert re.search(r"^  CPU tensors +init would fail: gpucomm: GPUCOMM_ALGO", got.stdout, re.M), got.stdout
