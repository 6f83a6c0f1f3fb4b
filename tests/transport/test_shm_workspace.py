"""The shm workspace: data and flags across real processes, bounds, timeouts, leaks, hostile peers."""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import signal
import stat
import subprocess
import sys
import time
import types
import warnings

import pytest
import torch
import torch.distributed as dist
from rank_store import rank_store, store_barrier
from spawn import run_ranks

from gpucomm.errors import (
    CommMismatchError,
    CommTimeoutError,
    GpucommError,
    UnsupportedError,
    WorkspaceUnavailableError,
)
from gpucomm.transport import TRANSPORTS, Workspace, cuda_ipc_available, open_workspace
from gpucomm.transport import shm as shm_module
from gpucomm.transport.processes import alive
from gpucomm.transport.workspace import Handshake

DATA_BYTES = 4099  # odd on purpose: not a multiple of 16, 256 or a page
FLAG_COUNT = 7
CPU = torch.device("cpu")


def _finish(store: dist.Store, name: str, rank: int, world_size: int) -> None:
    """Last store call of a rank: rank 0 hosts the TCPStore server, so it leaves last."""
    if rank:
        store.set(f"{name}/done/{rank}", b"1")
    else:
        store.wait([f"{name}/done/{r}" for r in range(1, world_size)], datetime.timedelta(seconds=60))


def _open(store, prefix, rank, world_size, timeout=30.0, data_bytes=DATA_BYTES, flag_count=FLAG_COUNT) -> Workspace:
    return open_workspace(
        "shm",
        store=store,
        prefix=prefix,
        rank=rank,
        world_size=world_size,
        data_bytes=data_bytes,
        flag_count=flag_count,
        device=CPU,
        timeout=timeout,
    )


def _pattern(seed: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randint(0, 256, (DATA_BYTES,), dtype=torch.uint8, generator=gen)


def _flag_value(writer: int, owner: int) -> int:
    # Large and distinct per (writer, owner), with bits in both 32-bit halves.
    return (writer + 1) << 40 | (owner + 1) << 8 | 0x5A


def _segments(prefix: str) -> list[str]:
    token = shm_module._prefix_token(prefix)
    return [name for name in os.listdir(shm_module.SHM_DIR) if name.startswith(f"gpucomm_{token}_")]


def _rank_data_check(rank, world_size, prefix, seed):
    store = rank_store(rank, world_size)
    ws = _open(store, prefix, rank, world_size)
    try:
        assert (ws.kind, ws.rank, ws.world_size, ws.device) == ("shm", rank, world_size, CPU)
        for peer in range(world_size):
            assert torch.count_nonzero(ws.flags(peer).bytes) == 0, f"peer {peer}'s flags not zero at open"
            assert ws.data(peer).nbytes == DATA_BYTES and ws.flags(peer).nbytes == FLAG_COUNT * 8
            assert ws.data(peer).addr % 256 == 0 and ws.flags(peer).addr % 4096 == 0
        store_barrier(store, f"{prefix}checked", rank, world_size)  # nobody writes before all checked zeros
        own = ws.data(rank)
        own.bytes.copy_(_pattern(seed, rank))
        for owner in range(world_size):  # one-sided writes into every peer's flag area
            ws.flag(owner, rank).view(torch.int64).fill_(_flag_value(rank, owner))
        ws.flag(rank, FLAG_COUNT - 1).view(torch.int64).fill_(-rank - 1)
        store_barrier(store, f"{prefix}written", rank, world_size)
        for peer in range(world_size):
            expected = _pattern(seed, peer)
            region = ws.data(peer)
            assert torch.equal(region.bytes, expected), f"rank {rank}: peer {peer}'s data differs (tensor view)"
            raw = ctypes.string_at(region.addr, region.nbytes)
            assert raw == expected.numpy().tobytes(), f"rank {rank}: peer {peer}'s data differs (raw address)"
            tail = ws.data(peer, 4000, 99)
            assert ctypes.string_at(tail.addr, 99) == expected[4000:].numpy().tobytes()
            assert ws.flag(peer, FLAG_COUNT - 1).view(torch.int64).item() == -peer - 1
        mine = ws.flags(rank, 0, world_size).view(torch.int64).tolist()
        assert mine == [_flag_value(writer, rank) for writer in range(world_size)], mine
        untouched = ws.flags(rank, world_size, FLAG_COUNT - 1 - world_size).bytes
        assert torch.count_nonzero(untouched) == 0
        store_barrier(store, f"{prefix}read", rank, world_size)
        _finish(store, prefix, rank, world_size)
        return _segments(prefix)
    finally:
        ws.close()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shm_data_and_flags_across_processes(world_size):
    prefix = f"data/{os.urandom(8).hex()}/"
    left = run_ranks(_rank_data_check, world_size, prefix, int.from_bytes(os.urandom(4), "little"), timeout=120)
    assert left == [[]] * world_size, "segments must be unlinked once every rank has opened"
    assert _segments(prefix) == []


def _in_process(prefix: str, **kw) -> Workspace:
    return _open(dist.HashStore(), prefix, 0, 1, **kw)


def test_bounds_and_argument_errors():
    ws = _in_process(f"bounds/{os.urandom(8).hex()}/")
    try:
        assert ws.data(0, 4099).nbytes == 0 and ws.data(0, 7).nbytes == DATA_BYTES - 7
        for bad in [dict(offset=-1), dict(offset=4000, nbytes=100), dict(offset=4100), dict(nbytes=-1)]:
            with pytest.raises(ValueError, match=r"Workspace\.data"):
                ws.data(0, **bad)
        with pytest.raises(ValueError, match=r"Workspace\.flags"):
            ws.flags(0, 5, 3)
        with pytest.raises(ValueError, match=r"Workspace\.flag: .*\[7, 8\)"):
            ws.flag(0, FLAG_COUNT)
        with pytest.raises(ValueError, match=r"peer must be in \[0, 1\), got 1"):
            ws.data(1)
        with pytest.raises(TypeError, match="peer must be an int"):
            ws.flags("0")
        with pytest.raises(TypeError, match="offset must be an int"):
            ws.data(0, 1.5)
    finally:
        ws.close()
    ws.close()  # idempotent
    with pytest.raises(GpucommError, match="closed"):
        ws.data(0)
    store = dist.HashStore()
    common = dict(store=store, rank=0, world_size=1, data_bytes=64, flag_count=1, device=CPU, timeout=5.0)
    with pytest.raises(ValueError, match="kind must be 'shm' or 'cuda_ipc', got 'nvlink'"):
        open_workspace("nvlink", prefix="a/", **common)
    with pytest.raises(ValueError, match="rank=1 world_size=1"):
        open_workspace("shm", prefix="b/", **{**common, "rank": 1})
    with pytest.raises(ValueError, match="data_bytes=-1"):
        open_workspace("shm", prefix="c/", **{**common, "data_bytes": -1})
    with pytest.raises(ValueError, match="needs device cpu"):
        open_workspace("shm", prefix="d/", **{**common, "device": torch.device("cuda", 0)})
    assert TRANSPORTS == ("shm", "cuda_ipc")


def test_timeout_names_the_missing_rank():
    prefix = f"timeout/{os.urandom(8).hex()}/"
    start = time.monotonic()
    with pytest.raises(CommTimeoutError) as info:
        _open(dist.HashStore(), prefix, 0, 3, timeout=1.5)
    elapsed = time.monotonic() - start
    assert info.value.missing == [1, 2] and info.value.rank == 0 and info.value.epoch is None
    assert "workspace open" in str(info.value) and "[1, 2]" in str(info.value)
    # The deadline is taken a moment after `start`, by another reading of the same clock; 1 ms
    # of slack for the rounding of two float subtractions (1.499998 s was seen).
    assert 1.5 - 1e-3 <= elapsed < 1.5 + 1.5, elapsed
    assert _segments(prefix) == [], "a failed open must unlink its own segment"


def _rank_never_opens(rank, world_size, prefix):
    store = rank_store(rank, world_size)
    if rank != 1:  # rank 1 joins the store but never opens the workspace
        start = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            _open(store, prefix, rank, world_size, timeout=2.0)
        own = [name for name in _segments(prefix) if name.endswith(f"_r{rank}")]
        result = info.value.missing, time.monotonic() - start, own
    _finish(store, prefix, rank, world_size)
    return result if rank != 1 else None


def test_timeout_across_processes():
    prefix = f"timeout2/{os.urandom(8).hex()}/"
    results = run_ranks(_rank_never_opens, 3, prefix, timeout=60)
    for rank in (0, 2):
        missing, elapsed, left = results[rank]
        assert missing == [1] and 2.0 <= elapsed < 4.0 and left == [], results[rank]


def test_segment_mode_is_0600_and_gone_after_open(monkeypatch):
    prefix = f"mode/{os.urandom(8).hex()}/"
    seen = []
    original = Handshake.opened

    def opened(self):
        # Runs before the segment is unlinked: the only moment it has a name.
        for name in _segments(prefix):
            seen.append(stat.S_IMODE(os.stat(os.path.join(shm_module.SHM_DIR, name)).st_mode))
        original(self)

    monkeypatch.setattr(Handshake, "opened", opened)
    old_umask = os.umask(0o002)  # a permissive umask must not widen the mode
    try:
        ws = _in_process(prefix)
    finally:
        os.umask(old_umask)
    try:
        assert seen == [0o600]
        assert _segments(prefix) == []
    finally:
        ws.close()


def _fds() -> tuple[int, int]:
    """(open fds, fds pointing into /dev/shm)."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the fd of the listing itself, closed by now
            pass
    return len(links), sum(link.startswith("/dev/shm/") for link in links)


def _mapped_gpucomm_segments() -> int:
    with open("/proc/self/maps") as maps:
        return sum("/dev/shm/gpucomm_" in line for line in maps)


def _rank_open_close_loop(rank, world_size, prefix, rounds):
    store = rank_store(rank, world_size)
    counts = []
    for i in range(rounds):
        ws = _open(store, f"{prefix}{i}/", rank, world_size)
        ws.data(rank).bytes.fill_(i % 256)
        held = ws.data((rank + 1) % world_size)  # a Region kept past close must stay safe
        ws.close()
        del held
        counts.append((_fds(), _mapped_gpucomm_segments()))
    # Every rank unlinks its own segment just after the last "opened" barrier: list /dev/shm
    # only once all ranks are past that, or a peer's last segment may still be there.
    store_barrier(store, f"{prefix}looped", rank, world_size)
    left = [_segments(f"{prefix}{i}/") for i in range(rounds)]
    _finish(store, prefix, rank, world_size)
    return counts, left


def test_open_close_loop_leaks_nothing():
    prefix = f"loop/{os.urandom(8).hex()}/"
    results = run_ranks(_rank_open_close_loop, 2, prefix, 50, timeout=120)
    for counts, left in results:
        assert all(not names for names in left)
        # The TCPStore's own sockets come and go; a leak of one fd per round would add 50.
        assert counts[-1][0][0] <= counts[0][0][0] + 2, f"fds grew over the loop: {counts}"
        assert {c[0][1] for c in counts} == {0}, "an fd into /dev/shm stayed open"
        assert {c[1] for c in counts} == {0}, "segments still mapped after close"


def _rank_killed_after_open(rank, world_size, prefix, seed, signum=signal.SIGKILL):
    store = rank_store(rank, world_size)
    ws = _open(store, prefix, rank, world_size)
    ws.data(rank).bytes.copy_(_pattern(seed, rank))
    store.set(f"{prefix}pid/{rank}", str(os.getpid()))
    store_barrier(store, f"{prefix}written", rank, world_size)
    if rank == 1:
        os.kill(os.getpid(), signum)
    # The dead rank's memory stays mapped here: its data is still readable.
    ok = torch.equal(ws.data(1).bytes, _pattern(seed, 1))
    ws.close()
    victim = int(store.get(f"{prefix}pid/1"))
    while alive(victim):  # rank 0 serves the store: it stays until rank 1 is past its last reply
        time.sleep(0.01)
    if rank == 2:
        store.set(f"{prefix}done/2", b"1")
    else:
        store.wait([f"{prefix}done/2"], datetime.timedelta(seconds=60))
    return ok


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_rank_killed_after_open_leaves_nothing_in_dev_shm(signum):
    """Killed between collectives (SIGTERM's default action is as abrupt as SIGKILL's): every
    segment was unlinked at the end of the open, the mappings alone keep the memory."""
    prefix = f"kill/{os.urandom(8).hex()}/"
    results = run_ranks(_rank_killed_after_open, 3, prefix, 1234, signum, timeout=120, allow_exit=(1,))
    assert results == [True, None, True]
    assert _segments(prefix) == []


def _hostile_cases(prefix: str, token: str) -> list[tuple[str, bytes, type[Exception], str]]:
    good = f"gpucomm_{token}_{'cd' * 4}_{os.getpid():x}_{'ab' * 8}_r1"
    size = 4096 + 256  # layout of data_bytes=64, flag_count=1

    def handle(name, size=size):
        return json.dumps({"name": name, "size": size}).encode()

    return [
        ("path traversal", handle("../../etc/passwd"), GpucommError, "expected one matching"),
        ("absolute path", handle("/etc/passwd"), GpucommError, "expected one matching"),
        ("other rank's name", handle(good[:-1] + "0"), GpucommError, "expected one matching"),
        ("other prefix", handle(good.replace(token, "0" * 16)), GpucommError, "expected one matching"),
        ("trailing newline", handle(good + "\n"), GpucommError, "expected one matching"),
        ("pickle", b"\x80\x04\x95cos\nsystem\n", GpucommError, "not ASCII JSON"),
        ("not an object", b'["x"]', GpucommError, "keys name and size"),
        ("extra key", json.dumps({"name": good, "size": size, "x": 1}).encode(), GpucommError, "keys name and size"),
        ("too long", b" " * 300, GpucommError, "not a handle"),
        ("size mismatch", handle(good, size + 256), CommMismatchError, "different data_bytes"),
    ]


def _open_against(prefix: str, peer_value: bytes) -> None:
    """Open as rank 0 of 2 with rank 1's handle already (maliciously) in the store, and its word
    that it opened rank 0's and read rank 0's failure (rank 0 waits for both before it raises:
    every rank raises together)."""
    store = dist.HashStore()
    store.set(f"{prefix}ws/1", peer_value)
    store.set(f"{prefix}ws_opened/1", b"1")
    store.set(f"{prefix}ws_opened_read/1", b"1")
    open_workspace(
        "shm", store=store, prefix=prefix, rank=0, world_size=2, data_bytes=64, flag_count=1, device=CPU, timeout=5.0
    )


@pytest.mark.parametrize("case", range(len(_hostile_cases("p/", "0" * 16))))
def test_hostile_store_values_are_refused_before_opening(monkeypatch, case):
    opened = []
    monkeypatch.setattr(shm_module, "_open_peer", lambda *a: opened.append(a))
    prefix = f"hostile/{os.urandom(8).hex()}/"
    what, value, error, message = _hostile_cases(prefix, shm_module._prefix_token(prefix))[case]
    with pytest.raises(error, match=message) as info:
        _open_against(prefix, value)
    assert "rank 1" in str(info.value), what
    assert opened == [], f"{what}: a peer segment was opened despite a hostile handle"
    assert _segments(prefix) == [], what


@pytest.mark.parametrize("plant", ["symlink", "mode 644"])
def test_planted_segment_with_valid_name_is_refused(tmp_path, plant):
    prefix = f"plant/{os.urandom(8).hex()}/"
    tokens = (shm_module._prefix_token(prefix), shm_module._space_token(), f"{os.getpid():x}", os.urandom(8).hex())
    name = "gpucomm_" + "_".join(tokens) + "_r1"
    path = os.path.join(shm_module.SHM_DIR, name)
    target = tmp_path / "target"
    target.write_bytes(b"\0" * (4096 + 256))
    if plant == "symlink":
        os.symlink(target, path)
        message = "cannot open segment"
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 4096 + 256)
        os.fchmod(fd, 0o644)
        os.close(fd)
        message = "has mode 644, expected 600"
    try:
        with pytest.raises(GpucommError, match=message):
            _open_against(prefix, json.dumps({"name": name, "size": 4096 + 256}).encode())
        assert _segments(prefix) == [name], "only the planted entry may remain"
    finally:
        os.unlink(path)


def _dead_pid() -> int:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(dead.stdout)


def test_dead_creators_segments_are_reaped_whatever_their_job_and_only_in_this_pid_space():
    """An open reaps any job's segment whose creator is dead here, not only its own prefix's (a
    crashed job's prefix is never drawn again); a live creator's, one from another pid namespace
    (its pid means another process there) and a name of another pattern are left."""
    mine, dead = shm_module._space_token(), _dead_pid()
    other_space = "0" * 8 if mine != "0" * 8 else "1" * 8
    crashed = f"gone/{os.urandom(8).hex()}/"  # another job's prefix
    token = shm_module._prefix_token(crashed)
    names = {
        "dead here": f"gpucomm_{token}_{mine}_{dead:x}_{os.urandom(8).hex()}_r0",
        "alive here": f"gpucomm_{token}_{mine}_{os.getpid():x}_{os.urandom(8).hex()}_r1",
        "other namespace": f"gpucomm_{token}_{other_space}_{dead:x}_{os.urandom(8).hex()}_r2",
        "no pid space": f"gpucomm_{token}_{dead:x}_{os.urandom(8).hex()}_r3",
    }
    for name in names.values():
        os.close(os.open(os.path.join(shm_module.SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    try:
        _in_process(f"next/{os.urandom(8).hex()}/").close()
        assert sorted(_segments(crashed)) == sorted(v for k, v in names.items() if k != "dead here")
    finally:
        for name in names.values():
            if os.path.exists(os.path.join(shm_module.SHM_DIR, name)):
                os.unlink(os.path.join(shm_module.SHM_DIR, name))


def _killed_in_the_window(rank, world_size, prefix, signum, timeout, record=None):
    """Open; this rank (every rank when ``signum`` is SIGKILL) dies by ``signum`` right after
    creating its segment, before any peer can open it, its path appended to ``record`` first. A
    survivor returns its error's type."""
    real = shm_module.create_segment

    def create_then_die(*args, **kwargs):
        fd = real(*args, **kwargs)
        if record is not None:
            with open(record, "a") as f:
                f.write(args[0] + "\n")
        if signum == signal.SIGKILL or rank == 1:
            os.kill(os.getpid(), signum)
        return fd

    shm_module.create_segment = create_then_die
    store = dist.HashStore() if signum == signal.SIGKILL else rank_store(rank, world_size)
    try:
        _open(store, prefix, rank, world_size, timeout=timeout).close()
    except GpucommError as exc:
        return type(exc).__name__
    return "opened"


def test_a_job_killed_inside_the_segment_window_leaves_nothing_after_the_next_job(tmp_path):
    """Only the dead job's own segments are looked at: other jobs on this machine have theirs."""
    prefix, record = f"window/{os.urandom(8).hex()}/", tmp_path / "created"
    run_ranks(_killed_in_the_window, 2, prefix, signal.SIGKILL, 30.0, str(record), timeout=120, allow_exit=(0, 1))
    created = record.read_text().split()
    try:
        assert len(created) == 2, created  # each rank died holding a segment (a rank that opens
        # after the other died reaps that one's, as does any other job's open on this machine)
        _in_process(f"next/{os.urandom(8).hex()}/").close()  # the next job, under a prefix of its own
        assert [path for path in created if os.path.exists(path)] == []
    finally:
        for name in _segments(prefix):
            os.unlink(os.path.join(shm_module.SHM_DIR, name))


def test_a_rank_sigtermed_during_init_leaves_nothing_once_its_peer_gives_up():
    prefix = f"term/{os.urandom(8).hex()}/"
    results = run_ranks(_killed_in_the_window, 2, prefix, signal.SIGTERM, 5.0, timeout=120, allow_exit=(1,))
    assert results == ["CommTimeoutError", None]
    assert _segments(prefix) == []


def test_cuda_ipc_reports_why_it_is_unavailable():
    ok, reason = cuda_ipc_available()
    if ok:
        pytest.skip("CUDA IPC is available here; tests/gpu covers it")
    assert "gpucomm: transport cuda_ipc needs CuPy" in reason
    with pytest.raises(Exception, match="cuda_ipc needs CuPy") as info:
        open_workspace(
            "cuda_ipc",
            store=dist.HashStore(),
            prefix="x/",
            rank=0,
            world_size=1,
            data_bytes=64,
            flag_count=1,
            device=torch.device("cuda", 0),
            timeout=5.0,
        )
    # An UnsupportedError, of the kind every rank raises together (auto falls back to gloo on it).
    assert type(info.value).__name__ == "WorkspaceUnavailableError"


def _cuda_handle(header: object, handle: bytes = bytes(range(64))) -> bytes:
    return json.dumps(header).encode() + b"\n" + handle


@pytest.mark.parametrize(
    "raw, error, message",
    [
        (
            _cuda_handle({"pid": 1, "pid_space": "b/1", "bus_id": "0000:3B:00.0", "size": 8192}, b"\0" * 63),
            GpucommError,
            "64 handle bytes",
        ),
        (b"\x80\x04\x95" + b"\0" * 64, GpucommError, "64 handle bytes"),
        (b"\xff\n" + bytes(64), GpucommError, "not ASCII JSON"),
        (
            _cuda_handle({"pid": 1, "pid_space": "b/1", "bus_id": "../../x", "size": 8192}),
            GpucommError,
            "malformed header",
        ),
        (
            _cuda_handle({"pid": "1", "pid_space": "b/1", "bus_id": "0000:3B:00.0", "size": 8192}),
            GpucommError,
            "malformed header",
        ),
        (
            _cuda_handle({"pid": 1, "pid_space": "b/1", "bus_id": "0000:3B:00.0", "size": 8192, "x": 0}),
            GpucommError,
            "malformed header",
        ),
        (
            _cuda_handle({"pid": 1, "pid_space": "b/1", "bus_id": "0000:3B:00.0", "size": 4096}),
            CommMismatchError,
            "different data_bytes",
        ),
        (b" " * 300 + b"\n" + bytes(64), GpucommError, "64 handle bytes"),
    ],
)
def test_cuda_ipc_handle_parsing_refuses_malformed_values(raw, error, message):
    from gpucomm.transport.cuda_ipc import _parse_handle

    with pytest.raises(error, match=message) as info:
        _parse_handle(raw, 3, 8192)
    assert "rank 3" in str(info.value)


def test_cuda_ipc_handle_parsing_accepts_a_well_formed_value():
    from gpucomm.transport.cuda_ipc import _parse_handle

    handle = bytes(range(10, 74))
    header, parsed = _parse_handle(
        _cuda_handle({"pid": 77, "pid_space": "b/1", "bus_id": "00000000:3B:00.0", "size": 8192}, handle), 1, 8192
    )
    assert header == {"pid": 77, "pid_space": "b/1", "bus_id": "00000000:3B:00.0", "size": 8192} and parsed == handle


# -- every rank takes the same decision ------------------------------------------------------------


def _rank_one_cannot(rank, world_size, prefix, failure):
    """Rank 1 cannot open its peers' segments (``failure``: the host's fault, or a peer's handle
    it refuses); every rank must raise at the same step, in seconds, leaving nothing behind."""
    store = rank_store(rank, world_size)
    if rank == 1:
        if failure == "unreachable":
            error = WorkspaceUnavailableError("shm", {1: "cannot open segment (faked)"}, "a fix")
        else:
            error = CommMismatchError("rank 1's view of a peer's size differs (faked)")

        def refuse(*args):
            raise error

        shm_module._open_peer = refuse
    start = time.monotonic()
    try:
        _open(store, prefix, rank, world_size, timeout=60.0).close()
    except GpucommError as err:
        outcome = type(err).__name__, str(err), time.monotonic() - start
    else:
        outcome = None, "", time.monotonic() - start
    store_barrier(store, f"{prefix}raised", rank, world_size)  # everyone raised: now list /dev/shm
    left = _segments(prefix)
    _finish(store, prefix, rank, world_size)
    return outcome, left


@pytest.mark.parametrize(
    "failure, error", [("unreachable", "WorkspaceUnavailableError"), ("mismatch", "CommMismatchError")]
)
def test_a_rank_that_cannot_open_makes_every_rank_raise_at_once(failure, error):
    prefix = f"agree/{os.urandom(8).hex()}/"
    for rank, ((kind, message, seconds), left) in enumerate(
        run_ranks(_rank_one_cannot, 3, prefix, failure, timeout=120)
    ):
        assert kind == error and "rank 1" in message and "(faked)" in message, (rank, kind, message)
        assert seconds < 20, f"rank {rank} took {seconds:.1f} s: it waited for the timeout instead of agreeing"
        assert left == [], left
    if failure == "unreachable":
        assert issubclass(WorkspaceUnavailableError, UnsupportedError)


class _SlowReads(dist.PrefixStore):
    """A store whose reads of the peers' words after opening take a second: the window in which
    rank 0, which serves the TCPStore, could have raised and exited."""

    def get(self, key):  # noqa: ANN001, ANN201 - dist.Store's signature
        if "/ws_opened/" in key:
            time.sleep(1.0)
        return super().get(key)


def _rank_zero_fails_and_leaves(rank, world_size, prefix):
    """Rank 0 cannot open rank 1's segment and its process ends as soon as it has raised (no
    barrier after); rank 1 reads slowly. Rank 1 must still raise the agreed error."""
    store = rank_store(rank, world_size)
    if rank == 0:

        def refuse(*args):
            raise WorkspaceUnavailableError("shm", {0: "cannot open segment (faked)"}, "a fix")

        shm_module._open_peer = refuse
        store = dist.PrefixStore("slow/", store)
    else:
        store = _SlowReads("slow/", store)
    try:
        _open(store, prefix, rank, world_size, timeout=60.0).close()
    except WorkspaceUnavailableError as err:
        return str(err)
    return None


def test_rank_0_stays_until_every_rank_has_read_the_failure():
    prefix = f"leave/{os.urandom(8).hex()}/"
    for message in run_ranks(_rank_zero_fails_and_leaves, 2, prefix, timeout=120):
        assert "rank 0: cannot open segment (faked)" in message, message


class _FakeRuntimeError(RuntimeError):
    pass


class _FakeRuntime:
    """The few calls of CuPy's CUDA runtime that open_cuda_ipc makes, on a GPU that is not there;
    ``refuse_open`` makes cudaIpcOpenMemHandle fail as it does without a shared IPC namespace."""

    CUDARuntimeError = _FakeRuntimeError

    def __init__(self, refuse_open: bool) -> None:
        self.refuse_open = refuse_open
        self.freed: list[int] = []
        self.closed: list[int] = []

    def getDeviceCount(self):  # noqa: N802 - CuPy's names
        return 1

    def deviceGetPCIBusId(self, dev):  # noqa: N802
        return "0000:3B:00.0"

    def deviceGetByPCIBusId(self, bus):  # noqa: N802
        return 0

    def malloc(self, size):
        return 0x7F0000000000

    def memset(self, ptr, value, size):
        pass

    def deviceSynchronize(self):  # noqa: N802
        pass

    def ipcGetMemHandle(self, ptr):  # noqa: N802
        return bytes(64)

    def ipcOpenMemHandle(self, handle, flags):  # noqa: N802
        if self.refuse_open:
            raise _FakeRuntimeError("cudaErrorMapBufferObjectFailed: mapping of buffer object failed")
        return 0x7E0000000000

    def ipcCloseMemHandle(self, ptr):  # noqa: N802
        self.closed.append(ptr)

    def free(self, ptr):
        # Whether every rank had unmapped its peers by then (freeing a buffer a peer still maps
        # is undefined behaviour for CUDA IPC).
        self.freed.append((ptr, self.all_unmapped()))


def _rank_cuda_ipc_open_refused(rank, world_size, prefix):
    import contextlib
    import types

    from gpucomm.transport import cuda_ipc

    runtime = _FakeRuntime(refuse_open=rank == 1)
    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime, Device=lambda dev: contextlib.nullcontext())
    )
    cuda_ipc._cupy = lambda: cupy
    cuda_ipc.alias_bytes = lambda base, size, device: torch.empty(size, dtype=torch.uint8)
    torch.cuda.is_available = lambda: True
    store = rank_store(rank, world_size)
    runtime.all_unmapped = lambda: store.check([f"{prefix}ws_closed/{r}" for r in range(world_size)])
    start = time.monotonic()
    try:
        open_workspace(
            "cuda_ipc",
            store=store,
            prefix=prefix,
            rank=rank,
            world_size=world_size,
            data_bytes=64,
            flag_count=1,
            device=torch.device("cuda", 0),
            timeout=60.0,
        )
    except WorkspaceUnavailableError as err:
        outcome = str(err), time.monotonic() - start, runtime.freed, runtime.closed
    _finish(store, prefix, rank, world_size)
    return outcome


def test_cuda_ipc_handle_that_cannot_be_opened_is_agreed_by_every_rank():
    """No GPU here: CuPy's runtime is faked, and rank 1's cudaIpcOpenMemHandle fails."""
    prefix = f"ipc/{os.urandom(8).hex()}/"
    for rank, (message, seconds, freed, closed) in enumerate(
        run_ranks(_rank_cuda_ipc_open_refused, 2, prefix, timeout=120)
    ):
        assert "rank 1: cudaIpcOpenMemHandle of rank 0's buffer failed" in message and "--ipc=host" in message, message
        assert seconds < 20, f"rank {rank} took {seconds:.1f} s"
        assert freed == [(0x7F0000000000, True)], "each rank frees its own buffer, once every rank unmapped its peers"
        assert closed == ([0x7E0000000000] if rank == 0 else []), "rank 0 unmaps the peer it had opened"


def _fake_cuda_ipc(rank, world_size, prefix, runtime):
    """open_cuda_ipc's CuPy replaced by ``runtime`` (no GPU here); the store this rank uses."""
    import contextlib

    from gpucomm.transport import cuda_ipc

    cupy = types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime, Device=lambda dev: contextlib.nullcontext())
    )
    cuda_ipc._cupy = lambda: cupy
    cuda_ipc.alias_bytes = lambda base, size, device: torch.empty(size, dtype=torch.uint8)
    torch.cuda.is_available = lambda: True
    store = rank_store(rank, world_size)
    runtime.all_unmapped = lambda: store.check([f"{prefix}ws_closed/{r}" for r in range(world_size)])
    return store


class _FaultedRuntime(_FakeRuntime):
    """After ``fault`` is set, every synchronize raises, as after a kernel that faulted."""

    fault = False

    def deviceSynchronize(self):  # noqa: N802 - CuPy's names
        if self.fault:
            raise _FakeRuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")


def _rank_closes_after_a_fault(rank, world_size, prefix):
    runtime = _FaultedRuntime(refuse_open=False)
    store = _fake_cuda_ipc(rank, world_size, prefix, runtime)
    ws = open_workspace(
        "cuda_ipc",
        store=store,
        prefix=prefix,
        rank=rank,
        world_size=world_size,
        data_bytes=64,
        flag_count=1,
        device=torch.device("cuda", 0),
        timeout=30.0,
    )
    runtime.fault = rank == 0
    start, raised = time.monotonic(), None
    try:
        ws.close()
    except _FakeRuntimeError as exc:
        raised = str(exc)
    outcome = raised, time.monotonic() - start, runtime.freed, runtime.closed
    _finish(store, prefix, rank, world_size)
    return outcome


def test_cuda_ipc_close_goes_on_past_a_faulted_synchronize():
    """Rank 0's synchronize raises (a kernel fault): it still unmaps its peer, meets the barrier
    and frees its buffer, then raises the fault; rank 1 does not wait out its timeout for it."""
    prefix = f"ipcfault/{os.urandom(8).hex()}/"
    results = run_ranks(_rank_closes_after_a_fault, 2, prefix, timeout=120)
    for rank, (raised, seconds, freed, closed) in enumerate(results):
        assert (raised is not None and "illegal memory access" in raised) == (rank == 0), (rank, raised)
        assert closed == [0x7E0000000000] and freed == [(0x7F0000000000, True)], (rank, closed, freed)
        # The timeout is 30 s; the closes took 0.2 ms and 21 ms here (2 shared cores, loaded).
        assert seconds < 10, f"rank {rank}'s close took {seconds:.1f} s"


def _rank_closes_with_a_dead_peer(rank, world_size, prefix):
    runtime = _FakeRuntime(refuse_open=False)
    store = _fake_cuda_ipc(rank, world_size, prefix, runtime)
    ws = open_workspace(
        "cuda_ipc",
        store=store,
        prefix=prefix,
        rank=rank,
        world_size=world_size,
        data_bytes=64,
        flag_count=1,
        device=torch.device("cuda", 0),
        timeout=30.0,
    )
    store.set(f"{prefix}pid/{rank}", str(os.getpid()))
    store_barrier(store, f"{prefix}opened", rank, world_size)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    victim = int(store.get(f"{prefix}pid/1"))
    while alive(victim):
        time.sleep(0.01)
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ws.close()
    return time.monotonic() - start, runtime.freed, [str(w.message) for w in caught]


def test_cuda_ipc_close_does_not_wait_for_a_peer_whose_process_ended():
    prefix = f"ipcdead/{os.urandom(8).hex()}/"
    results = run_ranks(_rank_closes_with_a_dead_peer, 2, prefix, timeout=120, allow_exit=(1,))
    seconds, freed, caught = results[0]
    # The timeout is 30 s (the old close waited it out, then warned); 0.3 ms measured here.
    assert seconds < 10 and caught == [], (seconds, caught)
    assert freed == [(0x7F0000000000, False)], freed  # rank 1 never met the barrier: it is gone


# -- space first, then memory ------------------------------------------------------------------


def test_a_segment_holds_its_pages_from_creation(monkeypatch):
    """A segment made with ftruncate alone is sparse: tmpfs finds each page at its first touch,
    and kills the process with SIGBUS when it has none left. Ours are whole from the start."""
    prefix = f"reserve/{os.urandom(8).hex()}/"
    sizes = []
    original = Handshake.exchange

    def exchange(self, handle):
        name = json.loads(handle)["name"]
        st = os.stat(os.path.join(shm_module.SHM_DIR, name))
        sizes.append((st.st_size, st.st_blocks * 512))
        return original(self, handle)

    monkeypatch.setattr(Handshake, "exchange", exchange)
    _in_process(prefix, data_bytes=1 << 20).close()
    ((size, allocated),) = sizes
    assert size == 4096 + (1 << 20) and allocated >= size, sizes


def test_no_dev_shm_at_all_is_the_hosts_reason(tmp_path):
    """A container without /dev/shm: the host's reason, which every rank agrees on and auto turns
    into gloo, not an OSError on one rank (a read-only one is the same errno family, EROFS)."""
    missing = tmp_path / "no-such-dir"
    with pytest.raises(WorkspaceUnavailableError, match=f"cannot create a segment of 4096 bytes in {missing}"):
        shm_module.create_segment(str(missing / "gpucomm_x"), 4096, 0)


def test_every_segment_gpucomm_creates_goes_through_create_segment():
    """The rule above holds for every segment: no file is created or sized in gpucomm's sources
    but in create_segment (a segment that grows must reserve its new pages the same way)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = []
    for folder, _, files in os.walk(os.path.join(root, "gpucomm")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path) as f:
                    for line in f:
                        if any(
                            sign in line
                            for sign in ("O_CREAT", "ftruncate(", "shm_open", "SharedMemory(", "memfd_create")
                        ):
                            found.append((os.path.relpath(path, root), line.strip()))
    # gpucomm.toolchain.native's build lock is the one other file gpucomm creates: an empty file per built
    # target in its cache (~/.cache/gpucomm by default), locked with flock and never sized or mapped.
    lock = (
        "gpucomm/toolchain/native.py",
        "fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)",
    )
    segment = (
        "gpucomm/transport/shm.py",
        "fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)",
    )
    assert sorted(found) == [lock, segment], found


def test_the_engines_of_one_communicator_agree_under_prefixes_of_their_own() -> None:
    """The engines of one communicator store their handles under prefixes that name their
    transport: on a GPU one communicator opens two engines at once (cuda_ipc and shm), and a rank
    done with one must never find its peers' handles of the other under its keys (read as its
    own kind, a CUDA IPC handle breaks the shm engine's opening)."""
    from types import SimpleNamespace

    from gpucomm.workspace.engine import Topology, engine_store_prefix

    for global_ranks, local_world_size in (([0, 1], 2), ([0, 1, 2, 3], 2)):  # one node, then two
        topology = Topology(SimpleNamespace(rank=1, local_world_size=local_world_size, global_ranks=global_ranks))
        shm, ipc = (engine_store_prefix("g/", t, topology) for t in ("shm", "cuda_ipc"))
        assert shm.startswith("g/") and ipc.startswith("g/")
        assert not shm.startswith(ipc) and not ipc.startswith(shm), (shm, ipc)


def test_cuda_ipc_takes_nvmls_word_for_a_peer_gpu_this_process_cannot_see(monkeypatch) -> None:
    """One GPU visible per rank: the peer's GPU is not in this process's list, but CUDA IPC opens
    its handles anyway where the two GPUs reach each other, which NVML (every GPU, by bus) says."""
    from gpucomm.transport import cuda_ipc

    class _Runtime:
        class CUDARuntimeError(RuntimeError):
            pass

        def deviceGetByPCIBusId(self, bus: str) -> int:  # noqa: N802 - CuPy's name
            raise self.CUDARuntimeError("cudaErrorInvalidDevice")

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=_Runtime()))
    for nvml, allowed in ((True, True), (False, False), (None, False)):
        monkeypatch.setattr(cuda_ipc, "_nvml_p2p_ok", lambda a, b, verdict=nvml: verdict)
        if allowed:
            cuda_ipc._check_peer_access(cupy, 0, "0000:18:00.0", 1, "0000:2a:00.0")
            continue
        with pytest.raises(
            UnsupportedError, match=r"rank 1's GPU 0000:2a:00.0 is not visible to this process \(GPU 0000:18:00.0\)"
        ):
            cuda_ipc._check_peer_access(cupy, 0, "0000:18:00.0", 1, "0000:2a:00.0")
