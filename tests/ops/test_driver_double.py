"""The driver double (tests/support/cuda_double) itself: it loads, resolves its entry points through
cuGetProcAddress as cuda.bindings does, refuses what the driver refuses, and records launches."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import cuda_double


def _run(script: str, log: str) -> None:
    """``script`` in a fresh process (the double reads its log's name when it loads)."""
    env = {**os.environ, cuda_double.LOG_VARIABLE: log}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def test_entry_points_resolve_through_get_proc_address_and_calls_are_recorded(tmp_path) -> None:
    library, log = cuda_double.build(), tmp_path / "calls.log"
    _run(
        f"""
        import ctypes
        lib = ctypes.CDLL({library!r})
        assert lib.cuDeviceGetCount(ctypes.byref(ctypes.c_int())) == 3  # CUDA_ERROR_NOT_INITIALIZED before cuInit
        assert lib.cuInit(0) == 0
        found, status = ctypes.c_void_p(), ctypes.c_int(-1)

        def proc_address(name: bytes) -> int:
            return lib.cuGetProcAddress_v2(name, ctypes.byref(found), 12000, 0, ctypes.byref(status))

        assert proc_address(b"cuInit") == 0 and status.value == 0
        assert found.value == ctypes.cast(lib.cuInit, ctypes.c_void_p).value
        # cuda.h maps cuStreamBeginCapture to its _v2; a name the double lacks is not found.
        assert proc_address(b"cuStreamBeginCapture") == 0
        assert found.value == ctypes.cast(lib.cuStreamBeginCapture_v2, ctypes.c_void_p).value
        assert proc_address(b"cuNoSuchThing") == 500 and status.value == 1
        major = ctypes.c_int()
        assert lib.cuDeviceGetAttribute(ctypes.byref(major), 75, 0) == 0 and major.value == 9
        image = b".entry program_kernel(\\x00"
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        assert lib.cuModuleLoadData(ctypes.byref(module), image) == 0
        assert lib.cuModuleGetFunction(ctypes.byref(function), module, b"other_kernel") == 500
        assert lib.cuModuleGetFunction(ctypes.byref(function), module, b"program_kernel") == 0
        params = (ctypes.c_int64 * 2)(7, -1)
        size = ctypes.c_size_t(16)
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(params), 2, ctypes.addressof(size), 0)
        assert lib.cuLaunchKernel(function, 3, 1, 1, 256, 1, 1, 64, ctypes.c_void_p(0x1234), None, extra) == 0
        assert lib.cuLaunchKernel(function, 3, 1, 1, 2048, 1, 1, 64, None, None, extra) == 1  # too many threads
        lib.doubleLaunches.restype = ctypes.c_ulonglong
        assert lib.doubleLaunches() == 1
        """,
        str(log),
    )
    (launch,) = cuda_double.records(log, "cuLaunchKernel")
    assert launch["name"] == "program_kernel" and launch["grid"] == "3,1,1" and launch["block"] == "256,1,1"
    assert launch["shared"] == "64" and launch["stream"] == "0x1234" and launch["form"] == "buffer"
    assert bytes.fromhex(launch["params"]) == (7).to_bytes(8, "little") + (-1).to_bytes(8, "little", signed=True)
    assert [r.entry for r in cuda_double.records(log)][:1] == ["cuInit"]


def test_a_graph_replays_the_launches_its_capture_recorded(tmp_path) -> None:
    library, log = cuda_double.build(), tmp_path / "calls.log"
    _run(
        f"""
        import ctypes
        lib = ctypes.CDLL({library!r})
        lib.cuInit(0)
        module, function, graph, exec_ = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        lib.cuModuleLoadData(ctypes.byref(module), b"k\\x00")
        lib.cuModuleGetFunction(ctypes.byref(function), module, b"k")
        word, size = ctypes.c_int64(5), ctypes.c_size_t(8)
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(word), 2, ctypes.addressof(size), 0)
        stream = ctypes.c_void_p(0x77)
        assert lib.cuStreamBeginCapture_v2(stream, 0) == 0
        assert lib.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, stream, None, extra) == 0
        assert lib.cuStreamEndCapture(stream, ctypes.byref(graph)) == 0
        word.value = 6  # the driver copied the parameters at capture
        assert lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), graph, 0) == 0
        assert lib.cuGraphLaunch(exec_, ctypes.c_void_p(0x88)) == 0
        """,
        str(log),
    )
    (captured,) = cuda_double.records(log, "cuLaunchKernel")
    (replayed,) = cuda_double.records(log, "cuGraphLaunch")
    assert captured["captured"] == "1" and captured["stream"] == "0x77"
    assert replayed["graph_stream"] == "0x88" and replayed["stream"] == "0x77"
    assert replayed["params"] == captured["params"] == (5).to_bytes(8, "little").hex()


def test_the_double_is_rebuilt_when_a_source_changes(tmp_path) -> None:
    first = cuda_double.build(tmp_path)
    assert cuda_double.build(tmp_path) == first
    assert ctypes.CDLL(first).cuDriverGetVersion  # exported
