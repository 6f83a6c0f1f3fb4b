"""Hostile hosts: a /dev/shm too small for the workspace, and a rank with a /dev/shm of its own.

Each case runs tests/support/scripts/hostile_shm.py in a private mount namespace (``unshare -m``) whose
/dev/shm is a small tmpfs, as a container's is. The default path must serve every CPU collective
through gloo, right, after one warning line per rank naming the bytes needed, the bytes free and
the two fixes; ``GPUCOMM_TRANSPORT=shm`` must raise WorkspaceUnavailableError on every rank in
seconds; no rank dies of a signal (before pages were reserved at creation, the first touch of a
page the tmpfs could not give killed a rank with SIGBUS and left its peer hanging); nothing is
left in /dev/shm. A /dev/shm with room for the workspaces but not for the symmetric heap makes
``gpucomm.empty`` (which opens the heap) raise on every rank, and the collectives go on.
Skipped, with the reason, where this process cannot make a mount namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from private_shm import namespace_refused
from spawn import free_port

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "scripts", "hostile_shm.py"
)
RUN_S = 240  # a hard limit per script run; the cases take a few seconds each


REFUSED = namespace_refused()
pytestmark = pytest.mark.skipif(bool(REFUSED), reason=REFUSED)


def _in_small_shm(size: str, *script_args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The script in a new mount namespace whose /dev/shm is a tmpfs of ``size``."""
    command = f'mount -t tmpfs -o size={size} tmpfs /dev/shm && exec "$0" "$@"'
    return subprocess.Popen(
        ["unshare", "-m", "sh", "-c", command, sys.executable, SCRIPT, *script_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _report(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=RUN_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the script hung for {RUN_S} s:\n{err[-3000:]}")
    assert proc.returncode == 0, f"exit code {proc.returncode} (negative: killed by that signal):\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def _check_fallback(results: list[dict], *needles: str) -> None:
    for rank, got in enumerate(results):
        assert got["path"] == "gloo" and got["wrong"] == [], (rank, got)
        assert len(got["warnings"]) == 1, (rank, got["warnings"])
        line = got["warnings"][0]
        assert "\n" not in line and f"gpucomm[rank {rank}]" in line and "CPU tensors go through gloo" in line, line
        for needle in needles:
            assert needle in line, (needle, line)


def _check_refused(results: list[dict], *needles: str) -> None:
    for rank, got in enumerate(results):
        assert got["error"] == "WorkspaceUnavailableError", (rank, got)
        assert got["seconds"] < 20, f"rank {rank} took {got['seconds']:.1f} s to raise: it waited instead of agreeing"
        for needle in needles:
            assert needle in got["message"], (needle, got["message"])


SPACE = ("bytes free of", "segment needs", "--shm-size", "GPUCOMM_WORKSPACE_BYTES")


# 2 ranks in 4 MiB: no rank has room. 4 ranks in 20 MiB: the first one fits its 11 MiB segment
# and the rest do not, so the rank that made its own learns it from its peers.
@pytest.mark.parametrize("world_size, size", [(2, "4M"), (4, "20M")])
def test_small_dev_shm_falls_back_to_gloo_or_raises_when_shm_is_asked_for(world_size: int, size: str) -> None:
    report = _report(_in_small_shm(size, "spawn", "auto,shm", str(world_size)))
    _check_fallback(report["results"]["auto"], *SPACE)
    _check_refused(report["results"]["shm"], *SPACE[:3], "GPUCOMM_TRANSPORT unset (auto)")
    assert report["left"] == [], f"left in /dev/shm: {report['left']}"


def test_a_rank_with_its_own_dev_shm_falls_back_with_the_reason() -> None:
    """Rank 1 shares the host name (and the store) but not /dev/shm, as a container with its own
    IPC namespace on the host's network does: neither can open the other's segment."""
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    outside = subprocess.Popen(
        [sys.executable, SCRIPT, "rank", "auto,shm"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "RANK": "0", "LOCAL_RANK": "0"},
    )
    inside = _in_small_shm("64M", "rank", "auto,shm", env={**env, "RANK": "1", "LOCAL_RANK": "1"})
    reports = [_report(outside), _report(inside)]
    reason = "share a host name but not /dev/shm"
    _check_fallback([r["results"]["auto"][0] for r in reports], reason, "No such file or directory", "flight record")
    _check_refused([r["results"]["shm"][0] for r in reports], reason)
    assert reports[1]["left"] == [], f"left in rank 1's /dev/shm: {reports[1]['left']}"


def test_a_dev_shm_without_room_for_the_heap_makes_empty_raise_on_every_rank() -> None:
    """30 MiB holds 2 ranks' workspaces (11 MiB each, and a 40 KiB flight record) but not their
    16 MiB symmetric heaps: the heap opens at the first gpucomm.empty, so init works, and every
    empty() raises WorkspaceUnavailableError on every rank (agreed, in seconds), naming the
    bytes and the fixes, while all_reduce on the workspace goes on working."""
    report = _report(_in_small_shm("30M", "spawn", "heap", "2"))
    for rank, got in enumerate(report["results"]["heap"]):
        assert got["path"] == "workspace transport=shm kernels=torch" and got["wrong"] == [], (rank, got)
        _check_refused(
            got["tries"],
            "bytes free of",
            "segment needs 16777216 bytes",
            "--shm-size",
            "GPUCOMM_HEAP_BYTES",
            "gpucomm.empty",
        )
    assert report["left"] == [], f"left in /dev/shm: {report['left']}"
