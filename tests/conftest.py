"""Shared pytest setup: the spawn harness on sys.path, ``--run-slow``, a /dev/shm leak check, and the
CUDA files compiled by nvcc once per session."""

from __future__ import annotations

import os
import sys
import time

import pytest

# tests/ has no __init__.py; pytest's prepend mode puts a test file's own folder on sys.path, which
# for tests/gpu/ is not tests/. Spawned ranks copy the parent's sys.path, so this covers them too.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

_SHM_DIR = "/dev/shm"
# A segment of a concurrent run (another checkout's tests) may be alive for a few milliseconds
# during its handshake; only entries still there after this pause count as leaks.
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
    arch) once per session (tests/cuda_tools.py): test_cuda_compile and test_bound_launch share them."""
    from cuda_tools import Fatbins

    return Fatbins(tmp_path_factory.mktemp("nvcc"))


def gpucomm_shm_entries() -> set[str]:
    """Names in /dev/shm that gpucomm's shm transport could have created."""
    try:
        return {name for name in os.listdir(_SHM_DIR) if name.startswith("gpucomm")}
    except FileNotFoundError:
        return set()


@pytest.fixture(scope="module", autouse=True)
def no_shm_leaks():
    """Fail the module if it leaves gpucomm* entries in /dev/shm (and remove them)."""
    before = gpucomm_shm_entries()
    yield
    new = gpucomm_shm_entries() - before
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
