"""Processes of this host: where a pid names a process, and whether that process still lives.

Transports name their shared segments after their creator's pid space and pid, and reap those
whose creator is gone; the liveness check names a dead peer the same way.
"""

from __future__ import annotations

import os

__all__ = ["alive", "pid_space"]


def pid_space() -> str:
    """Where this process's pid names it: this boot of this machine and this pid namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc here: only the host name says where a pid means anything
        return "-"
    return f"{boot}/{namespace}"


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited.

    A killed process stays in the process table as a zombie until its parent reaps it (a launcher
    may take a while), and signal 0 still reaches it; /proc says it is dead.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc here: signal 0 is all there is
    return state not in (b"Z", b"X")
