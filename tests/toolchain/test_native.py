"""gpucomm's host C code (kernels/host) compiles clean, and gpucomm.toolchain.native builds and caches it."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

from gpucomm.toolchain import native

SOURCES = sorted((pathlib.Path(__file__).resolve().parents[2] / "kernels" / "host").glob("*.c"))
CC = (sysconfig.get_config_var("CC") or "cc").split()[0]
if shutil.which(CC) is None:
    CC = "cc"
HEADERS = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


@pytest.mark.skipif(shutil.which(CC) is None or not HEADERS, reason="no C compiler or Python headers here")
@pytest.mark.parametrize("defines", [(), ("GPUCOMM_PUBLIC_FRAMES",)], ids=["default", "public-frames"])
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_without_a_warning(source, defines, tmp_path):
    flags = [
        "-O2",
        "-shared",
        "-fPIC",
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Wno-unused-parameter",
        "-Wno-missing-field-initializers",
        "-Werror",
        f"-I{sysconfig.get_paths()['include']}",
        *(f"-D{d}" for d in defines),
    ]
    out = subprocess.run([CC, *flags, str(source), "-o", str(tmp_path / "lib.so")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_file_is_built_once_and_then_loaded_from_the_cache(tmp_path):
    if shutil.which(CC) is None or not HEADERS:
        pytest.skip("no C compiler or Python headers here")
    code = (
        "from gpucomm.toolchain import native; import sys;"
        " sys.exit(0 if all(native.load(n) for n in sys.argv[1:]) else 1)"
    )
    env = {**os.environ, "GPUCOMM_CACHE_DIR": str(tmp_path)}
    names = [s.stem for s in SOURCES]
    subprocess.run([sys.executable, "-c", code, *names], env=env, check=True, timeout=120)
    built = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "native").iterdir()}
    assert sorted(name.split("-")[0] for name in built) == sorted(names)
    subprocess.run([sys.executable, "-c", code, *names], env=env, check=True, timeout=120)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "native").iterdir()} == built  # loaded, not rebuilt


def test_a_source_that_does_not_compile_leaves_the_twin(tmp_path, monkeypatch):
    broken = tmp_path / "src"
    broken.mkdir()
    (broken / "broken.c").write_text("this is not C\n")
    monkeypatch.setattr(native, "_source_dir", lambda: broken)
    monkeypatch.setenv("GPUCOMM_CACHE_DIR", str(tmp_path / "cache"))
    assert native.load.__wrapped__("broken") is None
    assert not [p for p in (tmp_path / "cache" / "native").iterdir()]  # no half-written library left


def test_the_build_lock_lets_one_process_build_at_a_time(tmp_path):
    """Ranks of a node building the same target take turns (their builds never overlap)."""
    import threading
    import time

    spans = []

    def build():
        with native.build_lock(tmp_path / "cache" / "lib.so"):
            start = time.monotonic()
            time.sleep(0.2)
            spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=build) for _ in range(3)]  # each opens the lock file itself
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans
    assert not (tmp_path / "cache").exists()  # the lock lives beside the folder, not in it
    assert [p.name for p in (tmp_path / "cache.locks").iterdir()] == ["lib.so.lock"]


def test_a_peer_stuck_in_its_build_only_delays_the_others(tmp_path, monkeypatch, caplog):
    import fcntl
    import time

    target = tmp_path / "cache" / "lib.so"
    with native.build_lock(target):
        pass  # creates the lock file
    held = os.open(tmp_path / "cache.locks" / "lib.so.lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)  # a peer that never finishes
    monkeypatch.setattr(native, "BUILD_WAIT_S", 0.3)
    try:
        start = time.monotonic()
        with caplog.at_level("WARNING", logger="gpucomm"), native.build_lock(target):
            waited = time.monotonic() - start
    finally:
        os.close(held)
    assert 0.3 <= waited < 5, waited
    assert "building here" in caplog.text
