"""The set-up of the tests that drive gpucomm's launcher (gpucomm.ops.launcher) on the driver
double (tests/support/cuda_double), shared by tests/ops/test_launcher.py and test_kernel_load.py.

- ``NEEDS_LAUNCHER``: skip where the launcher cannot be built (no C compiler);
- ``double``: the double's library path, built once per module;
- ``log``: the file the double records every driver call into during one test.

A test module imports ``double_fixture`` and ``log_fixture`` (pytest finds them under the names
``double`` and ``log``) and sets ``pytestmark = NEEDS_LAUNCHER``.
"""

from __future__ import annotations

import cuda_double
import pytest

from gpucomm.toolchain import native

__all__ = ["NEEDS_LAUNCHER", "double_fixture", "log_fixture"]

NEEDS_LAUNCHER = pytest.mark.skipif(
    native.load("launch") is None, reason="gpucomm's launcher cannot be built here (no C compiler)"
)


@pytest.fixture(scope="module", name="double")
def double_fixture() -> str:
    """The driver double's library path."""
    return cuda_double.build()


@pytest.fixture(name="log")
def log_fixture(double, tmp_path):
    """The file the double records this test's driver calls into."""
    path = tmp_path / "calls.log"
    cuda_double.log_to(double, path)
    yield path
    cuda_double.log_to(double, None)
