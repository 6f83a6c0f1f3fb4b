"""gpucomm's launcher (kernels/host/launch.c, gpucomm.ops.launcher) on the driver double: a bound
launch is one cuLaunchKernel carrying the packed parameters, on the stream it is given, and a
rewrite changes only the words it names. Without a GPU: the double records what the driver got."""

from __future__ import annotations

import ctypes
import struct

import cuda_double
import pytest
from launcher_double import NEEDS_LAUNCHER, double_fixture, log_fixture  # noqa: F401 (fixtures double, log)

from gpucomm.ops import launcher
from gpucomm.ops.launcher import LaunchBindError, Param
from gpucomm.toolchain import native

pytestmark = NEEDS_LAUNCHER

# A module image naming the kernels these tests ask for (PTX text; a cubin would hold them too).
IMAGE = b".entry k(\n.entry copy(\n.entry checked(\n\0"


def _function(double: str, name: str = "k") -> int:
    return launcher.driver(double).load(IMAGE, name, 0)


def test_a_bound_launch_is_one_driver_call_with_the_packed_parameters(double, log) -> None:
    params = [Param("a", 8, 0x7F00DEADBEEF), Param("n", 4, 3), Param("b", 8, -2), Param("c", 4, 2**32 - 1)]
    bound = launcher.bind(
        launcher.driver(double), _function(double), params, grid=(5, 1, 1), block=(256, 1, 1), shared=64
    )
    assert bound.layout == [(0, 8), (8, 4), (16, 8), (24, 4)]  # each at the next offset aligned to its size
    bound.launch(0xABC)
    bound()  # on the stream given at bind (0)
    first, second = cuda_double.records(log, "cuLaunchKernel")
    expected = struct.pack("<qi4xqI", 0x7F00DEADBEEF, 3, -2, 2**32 - 1)
    assert bytes.fromhex(first["params"]) == expected == bound.params
    assert (first["name"], first["grid"], first["block"], first["shared"], first["form"]) == (
        "k",
        "5,1,1",
        "256,1,1",
        "64",
        "buffer",
    )
    assert (first["stream"], second["stream"]) == ("0xabc", "0")


def test_a_value_that_does_not_fit_its_parameter_is_refused_at_the_bind(double) -> None:
    with pytest.raises(OverflowError, match="parameter 0 does not fit in 4 bytes"):
        launcher.bind(
            launcher.driver(double), _function(double), [Param("n", 4, 2**32)], grid=(1, 1, 1), block=(32, 1, 1)
        )
    with pytest.raises(OverflowError):
        launcher.bind(
            launcher.driver(double), _function(double), [Param("n", 4, -(2**31) - 1)], grid=(1, 1, 1), block=(32, 1, 1)
        )


def test_the_packing_is_checked_against_the_kernels_own_layout_where_the_driver_says_it(double, log) -> None:
    # The driver's cuFuncGetParamInfo (CUDA 12.4) reads the kernel's layout from its module; the
    # double answers it for a kernel whose layout the test declares.
    lib = ctypes.CDLL(double)
    offsets, sizes = (ctypes.c_size_t * 2)(0, 8), (ctypes.c_size_t * 2)(8, 8)
    assert lib.doubleSetParamInfo(b"checked", 2, offsets, sizes) == 0
    drv = launcher.driver(double)
    function = _function(double, "checked")
    assert drv.param_info(function) == [(0, 8), (8, 8)]
    launcher.bind(drv, function, [Param("a", 8, 1), Param("b", 8, 2)], grid=(1, 1, 1), block=(32, 1, 1)).launch(0)
    with pytest.raises(LaunchBindError, match=r"\[\(0, 8\), \(8, 8\)\].*packed as \[\(0, 8\), \(8, 4\)\]"):
        launcher.bind(drv, function, [Param("a", 8, 1), Param("b", 4, 2)], grid=(1, 1, 1), block=(32, 1, 1))
    assert drv.param_info(_function(double, "copy")) is None  # a kernel the driver cannot describe: not checked


def test_a_launch_captured_by_a_stream_is_replayed_with_the_parameters_it_was_bound_with(double, log) -> None:
    lib = ctypes.CDLL(double)
    bound = launcher.bind(
        launcher.driver(double), _function(double), [Param("a", 8, 41)], grid=(2, 1, 1), block=(32, 1, 1)
    )
    stream, graph, exec_ = 0x5EED, ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cuStreamBeginCapture_v2(ctypes.c_void_p(stream), 0) == 0
    bound.launch(stream)
    assert lib.cuStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph)) == 0
    assert lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0) == 0
    assert lib.cuGraphLaunch(exec_, ctypes.c_void_p(0x77)) == 0
    lib.cuGraphDestroy(graph)
    (captured,) = cuda_double.records(log, "cuLaunchKernel")
    (replayed,) = cuda_double.records(log, "cuGraphLaunch")
    assert captured["stream"] == hex(stream) and captured["captured"] == "1"
    assert replayed["params"] == captured["params"] == struct.pack("<q", 41).hex()


def test_a_driver_error_names_the_call_and_the_result(double) -> None:
    drv = launcher.driver(double)
    with pytest.raises(RuntimeError, match="cuModuleGetFunction failed: CUDA_ERROR_NOT_FOUND"):
        drv.load(IMAGE, "no_such_kernel", 0)
    bound = drv.bind(_function(double), (1, 1, 1), (2048, 1, 1), 0, [], [])  # more threads than a block has
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE"):
        bound.launch(0)


def test_a_missing_driver_is_an_os_error(tmp_path) -> None:
    with pytest.raises(OSError, match="cannot open"):
        native.load("launch").Driver(str(tmp_path / "libcuda.so.1"))
