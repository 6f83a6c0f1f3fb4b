"""gpucomm's build caches (gpucomm.toolchain.trusted_cache): nothing another user could have written is
loaded; a cache that fails the check is left for a private folder, after one warning; the build
lock is per target and refuses a symlink."""

from __future__ import annotations

import fcntl
import logging
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time

import pytest

from gpucomm.toolchain import native, trusted_cache

CC = (sysconfig.get_config_var("CC") or "cc").split()[0]
if shutil.which(CC) is None:
    CC = "cc"
BUILDS = shutil.which(CC) is not None and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
ROOT = os.geteuid() == 0
OTHER_UID = 54321  # no account: any uid but this process's will do

# A library whose constructor writes a marker file: loading it at all (dlopen) leaves the marker,
# whatever Python then makes of it.
PLANTED = textwrap.dedent("""
    #include <stdio.h>
    #include <stdlib.h>
    __attribute__((constructor)) static void planted(void) {
        const char *path = getenv("PLANTED_MARKER");
        FILE *f = path ? fopen(path, "w") : NULL;
        if (f) { fputs("foreign code ran\\n", f); fclose(f); }
    }
""")

LOAD = "from gpucomm.toolchain import native; m = native.load('atomics'); print('LOADED', m is not None and m.__file__)"


@pytest.fixture
def fresh(monkeypatch):
    """This process's verdict on the cache, as at start (each test judges its own cache)."""
    monkeypatch.setattr(trusted_cache, "_distrust", [])


def _load_in_child(cache: pathlib.Path, marker: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUCOMM_CACHE_DIR": str(cache), "PLANTED_MARKER": str(marker), "GPUCOMM_NATIVE": "1"}
    return subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300)


def _plant(cache: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """Build atomics.c into ``cache`` as gpucomm would, then put the planted library in its place:
    the path gpucomm computes and loads from."""
    done = _load_in_child(cache, tmp_path / "unused")
    assert "LOADED " + str(cache) in done.stdout, done.stdout + done.stderr
    (built,) = (cache / "native").glob("atomics-*")
    source = tmp_path / "planted.c"
    source.write_text(PLANTED)
    subprocess.run([CC, "-shared", "-fPIC", str(source), "-o", str(tmp_path / "planted.so")], check=True, timeout=120)
    shutil.copyfile(tmp_path / "planted.so", built)
    os.chmod(built, 0o700)
    return built


def _world_writable_root(cache, built):
    os.chmod(cache, 0o777)
    return "writable by group or others"


def _file_of_another_user(cache, built):
    os.chown(built, OTHER_UID, -1)
    return f"owned by uid {OTHER_UID}"


def _folder_of_another_user(cache, built):
    os.chown(built.parent, OTHER_UID, -1)
    return f"owned by uid {OTHER_UID}"


def _group_writable_file(cache, built):
    os.chmod(built, 0o770)
    return "writable by group or others"


def _symlink(cache, built):
    elsewhere = built.parent.parent.parent / "elsewhere.so"
    os.replace(built, elsewhere)
    os.symlink(elsewhere, built)
    return "is a symlink"


def _symlinked_root(cache, built):
    real = cache.parent / "real-cache"
    os.replace(cache, real)
    os.symlink(real, cache)
    return "is a symlink"


UNSAFE = [
    _world_writable_root,
    _file_of_another_user,
    _folder_of_another_user,
    _group_writable_file,
    _symlink,
    _symlinked_root,
]


@pytest.mark.skipif(not BUILDS, reason="no C compiler or Python headers here")
@pytest.mark.parametrize("spoil", UNSAFE, ids=lambda f: f.__name__.strip("_"))
def test_a_planted_library_is_never_loaded(spoil, tmp_path):
    """The planted library sits at the computed path of a cache that fails the check: gpucomm
    builds its own into a private folder, loads that, and says why in one warning."""
    if spoil in (_file_of_another_user, _folder_of_another_user) and not ROOT:
        pytest.skip("chown to another uid needs root")
    cache = tmp_path / "cache"
    built = _plant(cache, tmp_path)
    reason = spoil(cache, built)
    marker = tmp_path / "marker"
    done = _load_in_child(cache, marker)
    assert not marker.exists(), "the planted library was loaded"
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split("LOADED ", 1)[1].strip()
    assert loaded != "False" and "gpucomm-build-" in loaded and not loaded.startswith(str(cache)), done.stdout
    warnings = [line for line in done.stderr.splitlines() if "not using the build cache" in line]
    assert len(warnings) == 1 and reason in warnings[0] and str(cache) in warnings[0], done.stderr


@pytest.mark.skipif(not BUILDS, reason="no C compiler or Python headers here")
def test_a_safe_cache_is_reused(tmp_path):
    """The same plant in a cache that passes the check is loaded (the check above is what keeps
    it out), and a library gpucomm built is loaded again, not rebuilt."""
    cache = tmp_path / "cache"
    done = _load_in_child(cache, tmp_path / "unused")
    (built,) = (cache / "native").glob("atomics-*")
    first = built.stat().st_mtime_ns
    done = _load_in_child(cache, tmp_path / "unused")
    assert f"LOADED {built}" in done.stdout and built.stat().st_mtime_ns == first, done.stdout + done.stderr
    assert "not using the build cache" not in done.stderr
    _plant(cache, tmp_path)
    marker = tmp_path / "marker"
    _load_in_child(cache, marker)
    assert marker.exists()  # trusted, so loaded: the plant stands for this user's own files


def test_the_cache_folders_are_created_0700(tmp_path, monkeypatch, fresh):
    monkeypatch.setenv("GPUCOMM_CACHE_DIR", str(tmp_path / "new" / "cache"))
    old = os.umask(0)  # the loosest umask: the modes are gpucomm's own
    try:
        native_dir = trusted_cache.folder("native")
        kernels_dir = trusted_cache.folder("kernels")
    finally:
        os.umask(old)
    root = tmp_path / "new" / "cache"
    assert (native_dir, kernels_dir) == (root / "native", root / "kernels")
    for path in (root, native_dir, kernels_dir):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o700, path


def test_a_cache_that_fails_is_left_for_a_private_folder_with_one_warning(tmp_path, monkeypatch, fresh, caplog):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)
    monkeypatch.setenv("GPUCOMM_CACHE_DIR", str(cache))
    with caplog.at_level(logging.WARNING, logger="gpucomm"):
        first = trusted_cache.folder("native")
        second = trusted_cache.folder("kernels")
    assert first.parent == second.parent and "gpucomm-build-" in str(first) and not str(first).startswith(str(cache))
    assert stat.S_IMODE(os.lstat(first.parent).st_mode) == 0o700 and first.parent.stat().st_uid == os.geteuid()
    warnings = [r.getMessage() for r in caplog.records if "not using the build cache" in r.getMessage()]
    assert len(warnings) == 1 and str(cache) in warnings[0] and "mode 777" in warnings[0], warnings


def test_a_folder_above_the_cache_that_others_can_write_fails_unless_sticky(tmp_path, monkeypatch, fresh):
    shared = tmp_path / "shared"
    (shared / "cache").mkdir(parents=True, mode=0o700)
    os.chmod(shared, 0o777)  # another user could rename the cache away and put one of theirs there
    with pytest.raises(trusted_cache.UntrustedCache, match="above the cache"):
        trusted_cache.check(shared / "cache", shared / "cache")
    os.chmod(shared, 0o1777)  # as /tmp: others cannot rename or remove what is not theirs
    trusted_cache.check(shared / "cache", shared / "cache")


def test_kernels_kept_in_an_untrusted_cache_are_not_loaded(tmp_path, monkeypatch, fresh):
    """gpucomm.ops.triton_launch's kernel cache: a kept kernel (its JSON and cubin) is read only
    where both pass the check."""
    from gpucomm.ops.triton_launch import CachedKernel

    monkeypatch.setenv("GPUCOMM_CACHE_DIR", str(tmp_path / "cache"))
    folder = trusted_cache.folder("kernels")
    stored = folder / "k"
    record = '{"metadata": {"name": "k"}, "signature": {}, "constants": [], "hash": "h", "ptx": ""}'
    for suffix, data in ((".json", record.encode()), (".cubin", b"\x7fELF")):
        stored.with_suffix(suffix).write_bytes(data)
        os.chmod(stored.with_suffix(suffix), 0o600)
    assert CachedKernel.load(stored) is not None  # trusted: read
    os.chmod(stored.with_suffix(".cubin"), 0o666)
    assert CachedKernel.load(stored) is None
    assert trusted_cache.folder("kernels") != folder  # and the cache is left for the rest of the run


# -- the build lock ---------------------------------------------------------------------------------


def test_builds_of_different_targets_do_not_wait_for_each_other(tmp_path, monkeypatch, fresh):
    """Two ranks building two different files compile at once; the same file is compiled once."""
    monkeypatch.setenv("GPUCOMM_CACHE_DIR", str(tmp_path / "cache"))
    sources = tmp_path / "src"
    sources.mkdir()
    for name in ("slow", "quick"):
        (sources / f"{name}.c").write_text(f"int {name};\n")
    spans: dict[str, list[tuple[float, float]]] = {"slow": [], "quick": []}

    def compile_(compiler, flags, source, target, suffix):
        start = time.monotonic()
        time.sleep(1.0 if source.stem == "slow" else 0.05)
        target.write_bytes(b"built")
        os.chmod(target, 0o700)
        spans[source.stem].append((start, time.monotonic()))

    monkeypatch.setattr(native, "_compile", compile_)
    threads = [
        threading.Thread(target=native._build, args=(sources / f"{name}.c",)) for name in ("slow", "slow", "quick")
    ]
    threads[0].start()
    time.sleep(0.2)  # the slow build holds its lock
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()
    (slow,), (quick,) = spans["slow"], spans["quick"]  # each built once: the second slow waited, then loaded
    assert quick[1] < slow[1], (
        f"the quick build ended at {quick[1] - slow[0]:.2f} s, after the slow one's lock ({slow[1] - slow[0]:.2f} s)"
    )


def test_the_build_lock_refuses_a_symlink(tmp_path, caplog):
    target = tmp_path / "cache" / "native" / "lib.so"
    locks = tmp_path / "cache" / "native.locks"
    locks.mkdir(parents=True)
    victim = tmp_path / "victim"
    os.symlink(victim, locks / "lib.so.lock")
    with caplog.at_level(logging.WARNING, logger="gpucomm"), native.build_lock(target):
        pass
    assert not victim.exists(), "the lock followed the symlink and created its target"
    assert any("no build lock" in r.getMessage() and "lib.so.lock" in r.getMessage() for r in caplog.records), (
        caplog.text
    )


def test_the_build_lock_is_created_0600(tmp_path):
    target = tmp_path / "cache" / "native" / "lib.so"
    old = os.umask(0)
    try:
        with native.build_lock(target):
            pass
    finally:
        os.umask(old)
    lock = tmp_path / "cache" / "native.locks" / "lib.so.lock"
    assert stat.S_IMODE(os.lstat(lock).st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(lock.parent).st_mode) == 0o700


def test_a_held_lock_of_one_target_leaves_another_free(tmp_path):
    """Directly: a peer holding target a's lock does not delay target b's."""
    folder = tmp_path / "cache" / "native"
    with native.build_lock(folder / "a.so"):
        pass
    held = os.open(tmp_path / "cache" / "native.locks" / "a.so.lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        with native.build_lock(folder / "b.so"):
            waited = time.monotonic() - start
    finally:
        os.close(held)
    assert waited < 0.5, waited  # BUILD_WAIT_S is 120 s: a shared lock would have waited it out
