"""The driver double runs a host image's kernels: a launch through gpucomm's launcher moves data on a
host without a GPU, with the parameters the launcher packed, and a captured launch runs at each
replay of its graph, never at the capture (tests/support/cuda_double/host_run.c).

The library here is a few lines of C with the host-launch entry point gpucomm's CUDA C++ kernels
have when built for the host; tests/workspace/test_cuda_bound_launch.py runs those kernels this way."""

from __future__ import annotations

import ctypes
import subprocess

import cuda_double
import pytest
from launcher_double import NEEDS_LAUNCHER, double_fixture, log_fixture  # noqa: F401 (fixtures double, log)

from gpucomm.ops import launcher
from gpucomm.ops.launcher import Param

pytestmark = NEEDS_LAUNCHER

# add_one(long long *data, int n): every element + 1, one element per thread of the grid; a grid of
# 3 blocks x 4 threads covers 12 elements. Any other name is unknown (non-zero).
_LIBRARY = r"""
#include <string.h>
int gpucomm_host_launch(const char *kernel, unsigned grid_x, unsigned block_x, void **params,
                        unsigned long long seed) {
    (void)seed;
    if (strcmp(kernel, "add_one") != 0) return 1;
    long long *data = *(long long **)params[0];
    int n = *(int *)params[1];
    for (unsigned b = 0; b < grid_x; b++)
        for (unsigned t = 0; t < block_x; t++)
            if (b * block_x + t < (unsigned)n) data[b * block_x + t] += 1;
    return 0;
}
"""


@pytest.fixture(scope="module")
def host_image(tmp_path_factory) -> bytes:
    folder = tmp_path_factory.mktemp("host-image")
    (folder / "k.c").write_text(_LIBRARY)
    path = folder / "libk.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", str(folder / "k.c"), "-o", str(path)], check=True, timeout=60)
    return f"//gpucomm-host-image {path}\n.entry add_one(\n.entry unknown(\n".encode() + b"\0"


def _declare(double: str, name: bytes) -> None:
    offsets, sizes = (ctypes.c_size_t * 2)(0, 8), (ctypes.c_size_t * 2)(8, 4)
    assert ctypes.CDLL(double).doubleSetParamInfo(name, 2, offsets, sizes) == 0


def test_a_bound_launch_of_a_host_image_runs_its_kernel_on_the_packed_parameters(double, log, host_image) -> None:
    _declare(double, b"add_one")
    data = (ctypes.c_longlong * 16)(*range(16))
    drv = launcher.driver(double)
    function = drv.load(host_image, "add_one", 0)
    params = [Param("data", 8, ctypes.addressof(data)), Param("n", 4, 12)]
    bound = launcher.bind(drv, function, params, grid=(3, 1, 1), block=(4, 1, 1))
    bound.launch(0xABC)
    assert list(data) == [i + 1 for i in range(12)] + [12, 13, 14, 15]  # the grid's 12, no more
    (ran,) = cuda_double.records(log, "doubleHostRun")
    assert (ran["name"], ran["grid"], ran["block"], ran["failed"]) == ("add_one", "3", "4", "0")


def test_a_captured_launch_runs_at_each_replay_and_not_at_the_capture(double, log, host_image) -> None:
    _declare(double, b"add_one")
    lib = ctypes.CDLL(double)
    data = (ctypes.c_longlong * 4)()
    drv = launcher.driver(double)
    bound = launcher.bind(
        drv,
        drv.load(host_image, "add_one", 0),
        [Param("data", 8, ctypes.addressof(data)), Param("n", 4, 4)],
        grid=(1, 1, 1),
        block=(4, 1, 1),
    )
    stream, graph, exec_ = 0x5EED, ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cuStreamBeginCapture_v2(ctypes.c_void_p(stream), 0) == 0
    bound.launch(stream)
    assert lib.cuStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph)) == 0
    assert list(data) == [0, 0, 0, 0]  # captured, not run
    assert lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0) == 0
    assert lib.cuGraphLaunch(exec_, ctypes.c_void_p(0x77)) == 0
    assert lib.cuGraphLaunch(exec_, ctypes.c_void_p(0x77)) == 0
    assert lib.cuGraphDestroy(graph) == 0
    assert list(data) == [2, 2, 2, 2]
    assert [r["seed"] for r in cuda_double.records(log, "doubleHostRun")] == ["0", "0"]  # one order on every rank


def test_a_host_kernel_without_a_declared_layout_or_that_refuses_is_a_failed_launch(double, host_image) -> None:
    drv = launcher.driver(double)
    unknown = drv.load(host_image, "unknown", 0)  # named in the image, unknown to the library
    data = (ctypes.c_longlong * 1)()
    params = [Param("data", 8, ctypes.addressof(data)), Param("n", 4, 1)]
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE"):
        launcher.bind(drv, unknown, params, grid=(1, 1, 1), block=(1, 1, 1)).launch(0)  # no layout declared
    _declare(double, b"unknown")
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED"):
        launcher.bind(drv, unknown, params, grid=(1, 1, 1), block=(1, 1, 1)).launch(0)
    assert list(data) == [0]


def test_a_host_image_whose_library_cannot_be_loaded_is_an_invalid_image(double, tmp_path) -> None:
    image = f"//gpucomm-host-image {tmp_path / 'missing.so'}\n.entry k(\n".encode() + b"\0"
    with pytest.raises(RuntimeError, match="CUDA_ERROR_INVALID_IMAGE"):
        launcher.driver(double).load(image, "k", 0)
