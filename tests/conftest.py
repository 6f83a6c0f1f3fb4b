"""Shared pytest setup: tests/support (the shared helpers, the spawn harness among them) on
sys.path, ``--run-slow``, a /dev/shm leak check, and the CUDA files compiled by nvcc once per
session."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest

# The tests' shared helpers (tests/support) are imported by name: pytest's prepend mode puts only a
# test file's own folder on sys.path. Spawned ranks copy the parent's sys.path, so this covers them too.
_SUPPORT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "support")
if _SUPPORT_DIR not in sys.path:
    sys.path.insert(0, _SUPPORT_DIR)
# The support modules that hold tests' asserts (shared tests, checks of what ranks sent back) get
# pytest's assertion messages, as a test file's own asserts do.
pytest.register_assert_rewrite("collective_plans", "ddp_runs", "reduce_bits")
# Subprocesses a test starts (a test file run again as its own worker, a script) find them as well.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SUPPORT_DIR, os.environ.get("PYTHONPATH")) if p)

_SHM_DIR = "/dev/shm"
# A segment whose creator has just ended may still be reaped by its peers' next open; only
# entries still there after this pause count as leaks (and only those of ended processes:
# _left_behind).
_LEAK_SETTLE_S = 0.5


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture(scope="session")
def nvcc_fatbins(tmp_path_factory: pytest.TempPathFactory):
    """The shipped CUDA files compiled by nvcc as the loader has NVRTC compile them, each (file,
    arch) once per session (tests/support/cuda_tools.py), for every test that reads their PTX or
    loads their cubins on the driver double."""
    from cuda_tools import Fatbins

    return Fatbins(tmp_path_factory.mktemp("nvcc"))


def gpucomm_shm_entries() -> set[str]:
    """Names in /dev/shm that gpucomm's shm transport could have created."""
    try:
        return {name for name in os.listdir(_SHM_DIR) if name.startswith("gpucomm")}
    except FileNotFoundError:
        return set()


# gpucomm/transport/shm.py's names: gpucomm_<prefix token>_<pid space>_<creator's pid, hex>_<random>_r<rank>
# (and, before the pid space, without it).
_SEGMENT = re.compile(r"gpucomm_[0-9a-f]{16}_(?:[0-9a-f]{8}_)?([0-9a-f]{1,8})_[0-9a-f]{16}_r[0-9]+")


def _left_behind(name: str) -> bool:
    """Whether nothing will unlink ``name``: its creator is gone (or is this process, which is
    past its tests). A segment whose creator lives belongs to a handshake under way: another
    test run's, on a machine where several run at once; under load it can outlast the settling
    pause, and unlinking it would break that run."""
    match = _SEGMENT.fullmatch(name)
    if match is None:
        return True
    pid = int(match.group(1), 16)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
    except ProcessLookupError:
        return True
    except (PermissionError, OSError, IndexError):
        return False


@pytest.fixture(scope="module", autouse=True)
def no_shm_leaks():
    """Fail the module if it leaves gpucomm* entries in /dev/shm (and remove them)."""
    before = gpucomm_shm_entries()
    yield
    new = {name for name in gpucomm_shm_entries() - before if _left_behind(name)}
    if new:
        time.sleep(_LEAK_SETTLE_S)
        leaked = sorted(new & gpucomm_shm_entries())
        if leaked:
            for name in leaked:  # so that one leak does not fail every later module too
                try:
                    os.unlink(os.path.join(_SHM_DIR, name))
                except FileNotFoundError:
                    pass
            pytest.fail(f"this test module left {len(leaked)} entries in /dev/shm: {leaked}")
