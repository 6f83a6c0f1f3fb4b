"""The ``shm`` transport: every rank's workspace buffer in POSIX shared memory (/dev/shm).

Each rank creates ``/dev/shm/gpucomm_<prefix hash>_<pid space>_<pid>_<random>_r<rank>`` (mode
0600), maps it, and publishes ``{"name": ..., "size": ...}`` as JSON. Peers accept a name only if
it matches exactly the pattern expected for that rank under this prefix and the file is a regular
file owned by this user with no group/other permissions; nothing from the store is unpickled.

Once every rank has mapped every peer (the "opened" barrier) each rank unlinks its own name:
the mappings keep the memory alive, and nothing is left in /dev/shm even if a process is later
SIGKILLed. A process killed inside the handshake window (SIGKILL, or SIGTERM's default action)
leaves its segment, pages reserved. Every open, and every open that fails, removes this user's
segments whose creating process is dead (:func:`reap_dead`), whatever job made them: a crashed
job's prefix is never drawn again. The name carries where its creator's pid means that process
(this boot and pid namespace, :func:`gpucomm.transport.processes.pid_space`): a segment made in
another pid namespace (a container sharing this /dev/shm) is never judged, let alone removed.

**Space first, then memory.** A segment reserves every page when it is created
(:func:`create_segment`, :func:`reserve`: ``posix_fallocate``), so a /dev/shm too small for it
is an error at open, never a SIGBUS at the first touch of a page tmpfs cannot give. That error,
and a peer segment this rank cannot open (ranks that share a host name but not /dev/shm:
containers with their own IPC namespace), are :class:`~gpucomm.errors.WorkspaceUnavailableError`, which every
rank of the open raises together (:class:`~gpucomm.transport.workspace.Handshake`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import secrets
import stat

import torch

from gpucomm.errors import CommMismatchError, GpucommError, WorkspaceUnavailableError
from gpucomm.transport.mapping import Mapping
from gpucomm.transport.processes import alive, pid_space
from gpucomm.transport.workspace import Handshake, Workspace, buffer_layout

__all__ = ["open_shm", "create_segment", "reap_dead", "reserve", "space_advice", "SHM_DIR"]

SHM_DIR = "/dev/shm"
# A well-formed handle is ~80 bytes; anything much longer is not one of ours.
_MAX_HANDLE_BYTES = 256


def _prefix_token(prefix: str) -> str:
    return hashlib.sha256(prefix.encode("utf-8")).hexdigest()[:16]


def _space_token() -> str:
    """Where this process's pid means it (boot and pid namespace), in 8 hex digits.

    32 bits: two namespaces on one machine collide once in ~4e9 pairs.
    """
    return hashlib.sha256(pid_space().encode("utf-8")).hexdigest()[:8]


def _name_pattern(token: str, rank: int) -> re.Pattern[str]:
    # A peer's pid space may differ from ours (containers sharing /dev/shm but not pids). pid in
    # hex (<= 8 digits on Linux, pid_max <= 2**22) and 64 random bits: the random part keeps two
    # jobs that happen to use the same prefix on one host apart.
    return re.compile(rf"gpucomm_{token}_[0-9a-f]{{8}}_([0-9a-f]{{1,8}})_[0-9a-f]{{16}}_r{rank}")


# Any job's segment: (pid space, creator's pid in hex).
_ANY_SEGMENT = re.compile(r"gpucomm_[0-9a-f]{16}_([0-9a-f]{8})_([0-9a-f]{1,8})_[0-9a-f]{16}_r[0-9]+")


def reap_dead() -> list[str]:
    """Unlink this user's gpucomm segments whose creating process is dead; the names unlinked.

    A creator counts as dead only where its pid means the same process as here (module docstring).
    A live creator's segment is left (its handshake may be under way), and so is every name of
    another pattern.
    """
    space = _space_token()
    try:
        names = os.listdir(SHM_DIR)
    except OSError:  # no /dev/shm (the open says so), or one this user cannot list
        return []
    reaped = []
    for name in names:
        match = _ANY_SEGMENT.fullmatch(name)
        if match is None or match.group(1) != space or alive(int(match.group(2), 16)):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                os.unlink(path)
                reaped.append(name)
        except FileNotFoundError:  # another rank reaped it first
            pass
    return reaped


# Why a rank cannot open a peer's segment when the host, not the segment, is at fault: the
# name is not in this /dev/shm (another mount or IPC namespace), or another user owns it.
_UNREACHABLE = (errno.ENOENT, errno.EACCES, errno.EPERM)
# Limits of this process or host met while creating, opening or mapping segments: no descriptor
# left (per process, per system) or no memory for the mapping. The host's doing: every rank of
# the open raises it together, and the communicator falls back.
_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOMEM)
_LIMITS_ADVICE = (
    "This process ran out of file descriptors or memory for the mappings: raise the open-file "
    "limit (ulimit -n), or lower the memory it maps (GPUCOMM_WORKSPACE_BYTES, GPUCOMM_HEAP_BYTES)"
)


def _exhausted(rank: int, what: str, exc: OSError) -> WorkspaceUnavailableError:
    return WorkspaceUnavailableError("shm", {rank: f"{what}: {exc.strerror}"}, _LIMITS_ADVICE)


_NO_SHARED_SHM = (
    "The ranks share a host name but not /dev/shm: run them in one container, or give their "
    "containers the host's IPC namespace and /dev/shm (docker run --ipc=host)"
)


def space_advice(knob: str = "GPUCOMM_WORKSPACE_BYTES") -> str:
    """What gives a rank room in /dev/shm; ``knob`` is the size that made the segment.

    Containers get 64 MiB unless told otherwise.
    """
    return (
        "Give the container a larger /dev/shm (docker run --shm-size=1g; Kubernetes: an emptyDir of "
        f"medium Memory mounted at /dev/shm) or lower {knob}"
    )


# Why this rank cannot create its own segment when the host is at fault: no room (or no inode)
# left, no /dev/shm at all, or one this user cannot write.
_NO_ROOM = (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS)


def create_segment(path: str, size: int, rank: int, ranks: int = 1, knob: str = "GPUCOMM_WORKSPACE_BYTES") -> int:
    """Create ``path`` (mode 0600, exclusive) of ``size`` zero bytes, every page reserved; its fd.

    Every segment gpucomm creates in /dev/shm comes from here. ``rank`` is this rank in the open,
    one of ``ranks`` that each make one; ``knob`` is the size a user lowers to fit (named in the
    error's advice).

    Raises:
        WorkspaceUnavailableError: /dev/shm has no room for it (or is missing, or read-only),
            naming the bytes needed and free; nothing is left behind.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno not in _NO_ROOM:
            raise
        raise WorkspaceUnavailableError("shm", {rank: _no_room(path, size, ranks, exc)}, space_advice(knob)) from exc
    try:
        os.fchmod(fd, 0o600)  # the umask can only narrow the mode; make it exact
        reserve(fd, path, 0, size, rank, ranks, knob)  # a fresh file reads as zeros: every flag starts at 0
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def reserve(
    fd: int, path: str, offset: int, length: int, rank: int, ranks: int = 1, knob: str = "GPUCOMM_WORKSPACE_BYTES"
) -> None:
    """Give bytes ``[offset, offset + length)`` of segment ``fd`` (at ``path``) their pages now.

    Extends the segment if they lie past its end. ``ftruncate`` alone would only set a size, and
    tmpfs would look for each page at its first touch, killing the process with SIGBUS when it has
    none left: a segment that grows reserves its new pages here too.

    Raises:
        WorkspaceUnavailableError: no room for them (``rank`` of ``ranks`` names who asked).
    """
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno not in _NO_ROOM:
            raise
        raise WorkspaceUnavailableError("shm", {rank: _no_room(path, length, ranks, exc)}, space_advice(knob)) from exc


def _no_room(path: str, size: int, ranks: int, exc: OSError) -> str:
    folder = os.path.dirname(path)
    try:
        st = os.statvfs(folder)
    except OSError:
        return f"cannot create a segment of {size} bytes in {folder}: {exc.strerror}"
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    need = f"this rank's segment needs {size} bytes" + (
        f" ({ranks} ranks here need {ranks * size})" if ranks > 1 else ""
    )
    return f"{folder} has {free} bytes free of {total}, and {need} ({exc.strerror})"


def _map(fd: int, size: int) -> tuple[Mapping, torch.Tensor]:
    # The tensor holds an export of the mapping: nothing unmaps addresses a view can still read
    # (a symmetric tensor of the heap, a Region kept past close); see gpucomm.transport.mapping.
    mapping = Mapping(fd, size)
    return mapping, mapping.tensor


def _parse_handle(raw: bytes, peer: int, token: str, size: int) -> str:
    """The segment name in peer's published handle, after checking it is exactly what we expect."""
    where = f"gpucomm shm workspace: the handle of rank {peer}"
    if not isinstance(raw, bytes) or len(raw) > _MAX_HANDLE_BYTES:
        raise GpucommError(f"{where} is not a handle (expected <= {_MAX_HANDLE_BYTES} bytes of JSON, got {len(raw)})")
    try:
        handle = json.loads(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise GpucommError(f"{where} is not ASCII JSON: {raw[:80]!r}") from exc
    if not isinstance(handle, dict) or set(handle) != {"name", "size"}:
        raise GpucommError(f"{where} must be a JSON object with keys name and size, got {raw[:80]!r}")
    name, peer_size = handle["name"], handle["size"]
    pattern = _name_pattern(token, peer)
    if not isinstance(name, str) or pattern.fullmatch(name) is None:
        raise GpucommError(f"{where} names segment {name!r}, expected one matching {pattern.pattern!r}")
    if isinstance(peer_size, bool) or peer_size != size:
        raise CommMismatchError(
            f"{where} has a buffer of {peer_size!r} bytes, expected {size}: ranks passed different "
            "data_bytes or flag_count to open_workspace"
        )
    return name


def _open_peer(name: str, peer: int, size: int, rank: int) -> tuple[Mapping, torch.Tensor]:
    """Map ``peer``'s segment ``name`` into this process (this rank is ``rank``)."""
    path = os.path.join(SHM_DIR, name)
    try:
        # O_NOFOLLOW: a symlink planted under a valid name is refused, not followed.
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        message = f"cannot open segment {path} of rank {peer}: {exc.strerror}"
        if exc.errno in _UNREACHABLE:
            raise WorkspaceUnavailableError("shm", {rank: message}, _NO_SHARED_SHM) from exc
        if exc.errno in _EXHAUSTED:
            raise _exhausted(rank, f"cannot open segment {path} of rank {peer}", exc) from exc
        raise GpucommError(f"gpucomm shm workspace: {message}") from exc
    try:
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file"
        elif st.st_uid != os.getuid():
            raise WorkspaceUnavailableError(
                "shm",
                {
                    rank: f"segment {path} of rank {peer} is owned by uid {st.st_uid}, "
                    f"not by this process's uid {os.getuid()}"
                },
                "Run every rank of a node as the same user",
            )
        elif st.st_mode & 0o077:
            problem = f"has mode {stat.S_IMODE(st.st_mode):o}, expected 600"
        elif st.st_size != size:
            problem = f"holds {st.st_size} bytes, expected {size}"
        if problem:
            raise GpucommError(f"gpucomm shm workspace: segment {path} of rank {peer} {problem}")
        return _map(fd, size)
    except OSError as exc:  # fstat or mmap: agreed like the open's (Handshake.fail takes GpucommError)
        if exc.errno in _EXHAUSTED:
            raise _exhausted(rank, f"cannot map segment {path} of rank {peer}", exc) from exc
        raise GpucommError(f"gpucomm shm workspace: cannot map segment {path} of rank {peer}: {exc.strerror}") from exc
    finally:
        os.close(fd)


class _Segments:
    """The mappings of one shm workspace, and its own segment's name until it is unlinked.

    ``evict``: what :meth:`release` does with a mapping still viewed (:class:`Mapping`): give its
    memory back now (a workspace), or leave it to its last view (the symmetric heap)."""

    def __init__(self, evict: bool) -> None:
        self.maps: list[Mapping] = []
        self.own_path: str | None = None
        self.evict = evict

    def unlink_own(self) -> None:
        path, self.own_path = self.own_path, None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:  # a peer's reaper may have judged us dead (pid namespaces)
                pass

    def release(self) -> None:
        self.unlink_own()
        maps, self.maps = self.maps, []
        for mapping in maps:
            mapping.release(self.evict)


def open_shm(
    handshake: Handshake,
    *,
    data_bytes: int,
    flag_count: int,
    device: torch.device,
    size_knob: str = "GPUCOMM_WORKSPACE_BYTES",
    views_keep_memory: bool = False,
) -> Workspace:
    """Create, publish and map the shm workspace (module docstring).

    ``size_knob`` as :func:`create_segment`'s ``knob``. ``views_keep_memory``: a segment some
    view still holds at close stays mapped until its last view is freed (the symmetric heap,
    whose tensors are the caller's); otherwise close gives every segment's memory back at once
    (:mod:`gpucomm.transport.mapping`). Raises ValueError for a device other than
    the CPU; otherwise as :func:`gpucomm.transport.open_workspace`.
    """
    if device.type != "cpu":
        raise ValueError(f"open_workspace: the shm transport needs device cpu, got {device}")
    rank, world_size = handshake.rank, handshake.world_size
    _, size = buffer_layout(data_bytes, flag_count)
    token = _prefix_token(handshake.prefix)
    reap_dead()
    name = f"gpucomm_{token}_{_space_token()}_{os.getpid():x}_{secrets.token_hex(8)}_r{rank}"
    segments = _Segments(evict=not views_keep_memory)
    views: list[torch.Tensor | None] = [None] * world_size
    try:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = create_segment(path, size, rank, world_size, size_knob)
        except WorkspaceUnavailableError as exc:
            handshake.fail(exc)  # every peer raises it too, now, not at its timeout
        except OSError as exc:
            if exc.errno not in _EXHAUSTED:
                raise
            handshake.fail(_exhausted(rank, f"cannot create its segment {path}", exc))
        segments.own_path = path
        try:
            mm, views[rank] = _map(fd, size)
            segments.maps.append(mm)
        except OSError as exc:
            if exc.errno not in _EXHAUSTED:
                raise
            handshake.fail(_exhausted(rank, f"cannot map its segment {path}", exc))
        finally:
            os.close(fd)
        handles = handshake.exchange(json.dumps({"name": name, "size": size}).encode("ascii"))
        try:
            names = [
                _parse_handle(raw, peer, token, size) if peer != rank else name for peer, raw in enumerate(handles)
            ]
            for peer, peer_name in enumerate(names):
                if peer != rank:
                    mm, views[peer] = _open_peer(peer_name, peer, size, rank)
                    segments.maps.append(mm)
        except GpucommError as exc:
            handshake.fail(exc)
        handshake.opened()
        segments.unlink_own()
    except BaseException:
        views = []
        segments.release()
        reap_dead()  # a peer killed inside the window left its segment: its creator is dead now
        raise
    bases = [view.data_ptr() for view in views]
    return Workspace("shm", rank, world_size, device, data_bytes, flag_count, bases, views, segments.release)
