"""gpucomm's host C code (``kernels/host``), compiled on first use with the host's C compiler.

What runs on every call and is pure bookkeeping (the flight record's writer) costs a microsecond
or more in Python and tens of nanoseconds in C. Like the CUDA kernels, which NVRTC compiles at
first use, these files ship as source and are built where they run: one ``cc -O2 -shared`` per
file, Python version and source, cached under ``$GPUCOMM_CACHE_DIR`` (default
``~/.cache/gpucomm``) so that later processes only load the library. What is loaded from there
must pass :mod:`gpucomm.toolchain.trusted_cache`'s check (this user's, writable by no one else, no symlink
on the way); a cache that fails it is not used, and the process builds into a private folder. A host without a compiler
or Python's headers gets None, and the caller keeps its Python twin; ``GPUCOMM_NATIVE=0`` asks
for the twin everywhere.

Ranks that build the same file take turns (:func:`build_lock`, a file lock per built file): the
first compiles, the others wait and load what it built instead of compiling the same file at once
on the same cores; ranks building different files do not wait for each other. Each build writes
its own temporary file and renames it into place, so a reader never sees half a library (and a
rank that stopped waiting cannot spoil one).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import types
from collections.abc import Iterator

from gpucomm.toolchain import trusted_cache

__all__ = ["load", "cache_dir", "build_lock"]

# gpucomm/toolchain/native.py: the checkout's kernels/host is three levels up.
_SOURCES = pathlib.Path(__file__).resolve().parents[2] / "kernels" / "host"
_logger = logging.getLogger("gpucomm")
# One compile of a 300-line file takes about 0.4 s on the 2-core CI VM; a minute means a
# compiler that hangs.
_COMPILE_TIMEOUT_S = 60.0
# How long a process waits for another's build (build_lock) before it builds by itself: the
# longest build of a node's first calls is the program kernel for sm_90, 1.2 s alone on the 2-core
# VM (4.6 s with the machine loaded), so 8 ranks queue for well under this; a peer stuck that long
# (a hung compiler) must not hang the others.
BUILD_WAIT_S = 120.0


def _source_dir() -> pathlib.Path:
    """Where the ``.c`` files are: kernels/host in a checkout, gpucomm/_kernels/host installed."""
    if _SOURCES.is_dir():
        return _SOURCES
    return pathlib.Path(__file__).resolve().parents[1] / "_kernels" / "host"


def cache_dir() -> pathlib.Path:
    """Where compiled libraries are kept, as configured.

    :func:`gpucomm.toolchain.trusted_cache.folder` says whether this process uses it.
    """
    return trusted_cache.cache_root() / "native"


@functools.cache
def load(name: str, defines: tuple[str, ...] = ()) -> types.ModuleType | None:
    """The extension module built from ``kernels/host/<name>.c`` (module ``gpucomm_<name>``), or None.

    None where it cannot be built here or ``GPUCOMM_NATIVE=0``. Built once per process and
    ``defines`` (macros the file knows, for tests of its other branches).
    """
    if os.environ.get("GPUCOMM_NATIVE", "1") == "0":
        return None
    source = _source_dir() / f"{name}.c"
    try:
        library = _build(source, defines)
        spec = importlib.util.spec_from_file_location(
            f"gpucomm_{name}", library, loader=importlib.machinery.ExtensionFileLoader(f"gpucomm_{name}", str(library))
        )
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return module
    except (OSError, ImportError, subprocess.SubprocessError) as err:
        _logger.debug("gpucomm: %s.c not built (%s); its Python twin serves", name, err)
        return None


def _build(source: pathlib.Path, defines: tuple[str, ...] = ()) -> pathlib.Path:
    """The compiled library of ``source``, from the cache or compiled now."""
    text = source.read_bytes()
    include = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    # The compiler Python was built with, where this host has it; else the host's own.
    configured = shlex.split(sysconfig.get_config_var("CC") or "")[:1]
    compiler = configured if configured and shutil.which(configured[0]) else ["cc"]
    # No -Werror here: a compiler newer than this file's warnings would cost the user the C code
    # for nothing. tests/toolchain/test_native.py builds every file with -Wall -Werror.
    flags = ["-O2", "-shared", "-fPIC", "-std=c11", f"-I{include}", *(f"-D{d}" for d in defines)]
    # The interpreter's full version: the flight record's writer reads its private frame layout.
    key = hashlib.sha256(text + "\0".join([*compiler, *flags, "-ldl", suffix, sys.version]).encode()).hexdigest()[:16]
    name = f"{source.stem}-{key}{suffix}"
    folder = trusted_cache.folder("native")
    if trusted_cache.file_ok(folder, folder / name):
        return folder / name
    folder = trusted_cache.folder("native")  # the private folder, where the file failed the check
    target = folder / name
    with build_lock(target):
        if not trusted_cache.file_ok(folder, target):  # a peer may have built it while this process waited
            _compile(compiler, flags, source, target, suffix)
    return target


def _compile(compiler: list[str], flags: list[str], source: pathlib.Path, target: pathlib.Path, suffix: str) -> None:
    fd, scratch = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}-", suffix=suffix)
    os.close(fd)
    try:
        # -ldl: the launcher (launch.c) reaches the CUDA driver through dlopen (libc's own since glibc 2.34).
        subprocess.run(
            [*compiler, *flags, str(source), "-o", scratch, "-ldl"],
            check=True,
            capture_output=True,
            timeout=_COMPILE_TIMEOUT_S,
        )
        os.chmod(scratch, 0o700)  # the linker writes it afresh under the umask: writable by this user only
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


@contextlib.contextmanager
def build_lock(target: pathlib.Path | str) -> Iterator[None]:
    """Hold a lock while this process builds ``target``, so that the ranks of a node build it once.

    ``target`` is a file in a folder of :func:`gpucomm.toolchain.trusted_cache.folder` (host code
    here, program kernels in gpucomm.ops.triton_launch). Processes building the same target take
    turns, so one builds it and the others load it; processes building different targets do not wait
    for each other.

    Waits at most BUILD_WAIT_S. Where the lock cannot be taken (a file system without locks, a lock
    file that is a symlink or another user's) or the wait runs out, the process builds without it.

    The lock is the file ``<target's name>.lock`` in ``<folder>.locks`` beside the target's folder,
    which holds only what was built. It is opened with O_NOFOLLOW (a symlink planted there is refused,
    never followed) and created 0600.
    """
    target = pathlib.Path(target)
    path = f"{os.path.normpath(target.parent)}.locks/{target.name}.lock"
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as err:
        log = _logger.warning if err.errno == errno.ELOOP else _logger.debug
        log("gpucomm: no build lock at %s (%s); building without it", path, err.strerror)
        yield
        return
    try:
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():
            _logger.warning("gpucomm: the build lock %s is uid %d's, not this user's; building without it", path, owner)
            yield
            return
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    _logger.warning(
                        "gpucomm: waited %.0f s for another process's build of %s; building here", BUILD_WAIT_S, target
                    )
                    break
                time.sleep(0.02)
            except OSError as err:
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                break  # this file system has no locks
        yield
    finally:
        os.close(fd)  # releases the lock
