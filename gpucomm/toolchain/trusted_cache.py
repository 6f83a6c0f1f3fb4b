"""gpucomm's on-disk caches of built code, used only where no other user could have written them.

gpucomm loads what it finds in its caches and runs it (host libraries in ``native/``, Triton
kernels in ``kernels/``), so a file another user put there would be that user's code run as this
one: a team cache on a shared disk (a world-writable ``GPUCOMM_CACHE_DIR``), a folder created with
a loose umask, a symlink to somewhere else. The rule, checked before anything there is read:

- the cache root (``$GPUCOMM_CACHE_DIR``, default ``~/.cache/gpucomm``), every folder below it
  down to the file, and the file itself: looked at with ``lstat`` (a symlink is refused, never
  followed), owned by this process's user, not writable by group or others (gpucomm creates them
  0700, files 0600 or 0700);
- the folders above the root (``~/.cache``, ``~``, ``/``; their real path, so a home reached
  through a symlink is fine): owned by this user or root, and writable by group or others only
  with the sticky bit (``/tmp``), so that no one else can rename or replace what lies below.

A cache that fails the check is not used: gpucomm builds into a private folder of this process
instead (``mkdtemp``, 0700, removed at exit), after one warning that names the path and why. The
rest of the work is unchanged, only slower (every process builds for itself).
"""

from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import pathlib
import shutil
import stat
import tempfile

__all__ = ["cache_root", "folder", "file_ok", "check", "UntrustedCache"]

_logger = logging.getLogger("gpucomm")


class UntrustedCache(Exception):
    """A path of the cache another user could have written (the message says which and why).

    Never raised out of gpucomm: it sends the build to the private folder.
    """


def cache_root() -> pathlib.Path:
    """The configured cache root: ``$GPUCOMM_CACHE_DIR``, default ``~/.cache/gpucomm``."""
    root = os.environ.get("GPUCOMM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "gpucomm")
    return pathlib.Path(os.path.abspath(root))


def _check_one(path: pathlib.Path, st: os.stat_result, *, below_root: bool) -> None:
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise UntrustedCache(f"{path} is a symlink")
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise UntrustedCache(f"{path} is neither a folder nor a regular file")
    if below_root:
        if st.st_uid != uid:
            raise UntrustedCache(f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})")
        if st.st_mode & 0o022:
            raise UntrustedCache(f"{path} has mode {stat.S_IMODE(st.st_mode):o}: writable by group or others")
    else:
        if st.st_uid not in (uid, 0):
            raise UntrustedCache(
                f"{path} (above the cache) is owned by uid {st.st_uid}, neither this user (uid {uid}) nor root"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UntrustedCache(
                f"{path} (above the cache) has mode {stat.S_IMODE(st.st_mode):o}: "
                "writable by group or others, without the sticky bit"
            )


def check(root: pathlib.Path, path: pathlib.Path) -> None:
    """Raise :class:`UntrustedCache` unless ``path`` and the folders around it pass the module's rule.

    Checked: ``path`` (``root`` or below it, existing), every folder from ``root`` down to it, and
    every folder above ``root``.
    """
    relative = path.relative_to(root)  # ValueError for a path outside the root: a caller's bug
    above = pathlib.Path(os.path.realpath(root.parent))
    for parent in (above, *above.parents):
        _check_one(parent, os.lstat(parent), below_root=False)
    for current in (root, *(root / part for part in itertools.accumulate(relative.parts, os.path.join))):
        _check_one(current, os.lstat(current), below_root=True)


def folder(name: str) -> pathlib.Path:
    """The checked folder ``name`` of the cache (``native``, ``kernels``), created 0700 where missing.

    Where the cache fails the check (now or before in this process), this process's private folder
    instead.
    """
    if _distrust:
        return private(name, _distrust[0])
    root = cache_root()
    path = root / name
    try:
        # Missing folders, the ones above the root too (~/.cache on a fresh account), are created
        # 0700 whatever the umask: gpucomm's own are never what fails the check.
        for target in (*reversed(path.parents[:-1]), path):
            if target.exists():
                continue
            try:
                os.mkdir(target, 0o700)
                os.chmod(target, 0o700)  # the umask can only narrow the mode; make it exact
            except FileExistsError:
                pass
        check(root, path)
    except (UntrustedCache, OSError) as err:
        return private(name, str(err))
    return path


def file_ok(folder_path: pathlib.Path, path: pathlib.Path) -> bool:
    """Whether ``path`` (in ``folder_path``, from :func:`folder`) may be read.

    True where it passes the check; False where it does not exist; False after one warning where it
    exists and fails (and from then on :func:`folder` does not hand out this cache either).
    """
    root = cache_root()
    if not _is_below(folder_path, root):
        return _private_file_ok(path)
    try:
        check(root, path)
    except FileNotFoundError:
        return False
    except (UntrustedCache, OSError) as err:
        private(folder_path.name, str(err))
        return False
    return True


def _private_file_ok(path: pathlib.Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _is_below(path: pathlib.Path, root: pathlib.Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def private(name: str, reason: str) -> pathlib.Path:
    """This process's private folder ``name``.

    The first time, it gives the one warning that says why the cache is not used; from then on this
    process does not use it.
    """
    if not _distrust:
        _distrust.append(reason)
        _logger.warning(
            "gpucomm: not using the build cache: %s; building into a private folder of this process instead", reason
        )
    path = _private_root() / name
    path.mkdir(mode=0o700, exist_ok=True)
    return path


# Why this process stopped using the cache (one entry at most): it warns once, then keeps away.
_distrust: list[str] = []


@functools.cache
def _private_root() -> pathlib.Path:
    path = pathlib.Path(tempfile.mkdtemp(prefix="gpucomm-build-"))  # mkdtemp: 0700, this user's
    atexit.register(shutil.rmtree, path, True)
    return path
