"""Whether a test can run ranks in a private mount namespace with a /dev/shm of its own size
(``unshare -m`` and a tmpfs mount: root or CAP_SYS_ADMIN), for the tests that fill /dev/shm."""

from __future__ import annotations

import subprocess

__all__ = ["namespace_refused"]


def namespace_refused() -> str:
    """Why a private mount namespace with its own /dev/shm cannot be made here ("" if it can)."""
    try:
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /dev/shm"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare could not run: {exc}"
    if probe.returncode != 0:
        return f"unshare -m / mount refused (needs root or CAP_SYS_ADMIN): {probe.stderr.strip()[:200]}"
    return ""
