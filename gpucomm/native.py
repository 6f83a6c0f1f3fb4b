"""gpucomm's host C code (``kernels/host``), compiled on first use with the host's C compiler.

What runs on every call and is pure bookkeeping (the flight record's writer) costs a microsecond
or more in Python and tens of nanoseconds in C. Like the CUDA kernels, which NVRTC compiles at
first use, these files ship as source and are built where they run: one ``cc -O2 -shared`` per
file, Python version and source, cached under ``$GPUCOMM_CACHE_DIR`` (default
``~/.cache/gpucomm``) so that later processes only load the library. A host without a compiler
or Python's headers gets None, and the caller keeps its Python twin; ``GPUCOMM_NATIVE=0`` asks
for the twin everywhere.

Ranks that start together may compile the same file at once: each writes its own temporary file
and renames it into place, so a reader never sees half a library.
"""

from __future__ import annotations

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
import types

__all__ = ["load", "cache_dir"]

_SOURCES = pathlib.Path(__file__).resolve().parent.parent / "kernels" / "host"
_logger = logging.getLogger("gpucomm")
# One compile of a 300-line file takes about 0.4 s on the 2-core CI VM; a minute means a
# compiler that hangs.
_COMPILE_TIMEOUT_S = 60.0


def _source_dir() -> pathlib.Path:
    """Where the ``.c`` files are: kernels/host in a checkout, gpucomm/_kernels/host installed."""
    if _SOURCES.is_dir():
        return _SOURCES
    return pathlib.Path(__file__).resolve().parent / "_kernels" / "host"


def cache_dir() -> pathlib.Path:
    """Where compiled libraries are kept."""
    root = os.environ.get("GPUCOMM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpucomm")
    return pathlib.Path(root) / "native"


@functools.cache
def load(name: str, defines: tuple[str, ...] = ()) -> types.ModuleType | None:
    """The extension module built from ``kernels/host/<name>.c`` (module ``gpucomm_<name>``), or
    None where it cannot be built here or ``GPUCOMM_NATIVE=0``. Once per process and
    ``defines`` (macros the file knows, for tests of its other branches)."""
    if os.environ.get("GPUCOMM_NATIVE", "1") == "0":
        return None
    source = _source_dir() / f"{name}.c"
    try:
        library = _build(source, defines)
        spec = importlib.util.spec_from_file_location(f"gpucomm_{name}", library, loader=importlib.machinery.ExtensionFileLoader(f"gpucomm_{name}", str(library)))
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
    # for nothing. tests/test_native.py builds every file with -Wall -Werror.
    flags = ["-O2", "-shared", "-fPIC", "-std=c11", f"-I{include}", *(f"-D{d}" for d in defines)]
    # The interpreter's full version: the flight record's writer reads its private frame layout.
    key = hashlib.sha256(text + "\0".join([*compiler, *flags, "-ldl", suffix, sys.version]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}{suffix}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}-", suffix=suffix)
    os.close(fd)
    try:
        # -ldl: the launcher (launch.c) reaches the CUDA driver through dlopen (libc's own since glibc 2.34).
        subprocess.run([*compiler, *flags, str(source), "-o", scratch, "-ldl"], check=True, capture_output=True, timeout=_COMPILE_TIMEOUT_S)
        os.replace(scratch, target)
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target
