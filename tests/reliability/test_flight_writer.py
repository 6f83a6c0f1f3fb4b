"""The flight record's writer: C's Recorder (kernels/host/flight_record.c) and its Python twin
write the same slots and find the same call sites, through gpucomm's own frames, taught once."""

from __future__ import annotations

import mmap
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

import gpucomm
from gpucomm.reliability.flight import _RING_AT, _SLOT, RING, SEGMENT_BYTES, PyRecorder, teach
from gpucomm.toolchain import native

GPUCOMM_DIR = pathlib.Path(gpucomm.__file__).resolve().parent
CALL = (3, 4, 1024, 5, -1, 6)  # collective, dtype, count, op, root, group (ids as interned)


def _compiler_here() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None and os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))


class Strings:
    """A string table standing in for FlightRecord.intern, counting what it is asked."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {"": 0}
        self.asked = 0

    def intern(self, text: str) -> int:
        self.asked += 1
        return self.ids.setdefault(text, len(self.ids))

    def text(self, ident: int) -> str:
        return {v: k for k, v in self.ids.items()}[ident]


def _writer(kind: str, segment: memoryview, strings: Strings) -> object:
    holder: list[object] = []

    def teacher(frame):
        return teach(holder[0], strings.intern, frame)

    if kind == "python":
        holder.append(PyRecorder(segment, _RING_AT, RING, teacher))
    else:
        # "c-public": the walk through frame objects, which CPython other than 3.11 and 3.12 takes
        module = native.load("flight_record", ("GPUCOMM_PUBLIC_FRAMES",) if kind == "c-public" else ())
        if module is None:
            pytest.skip("no C compiler or Python headers here: the Python twin serves")
        holder.append(module.Recorder(segment, _RING_AT, RING, teacher))
    return holder[0]


@pytest.fixture(params=["c", "c-public", "python"])
def setup(request):
    buffer = mmap.mmap(-1, SEGMENT_BYTES)
    segment = memoryview(buffer)
    strings = Strings()
    writer = _writer(request.param, segment, strings)
    yield writer, segment, strings
    writer.close()
    segment.release()
    buffer.close()


def _internal(name: str, body: str) -> object:
    """A function whose code says it is gpucomm's own, as a collective's frames do."""
    namespace: dict[str, object] = {}
    exec(
        compile(f"def {name}(writer, seq, call):\n    {body}\n", str(GPUCOMM_DIR / "fake_frames.py"), "exec"), namespace
    )
    return namespace[name]


inner = _internal("inner", "return writer.enter(seq, call)")
outer = _internal("outer", "return inner(writer, seq, call)")
outer.__globals__["inner"] = inner


def test_slot_holds_the_call_and_the_first_outside_frame(setup):
    writer, segment, strings = setup
    at, line = outer(writer, 7, CALL), sys._getframe().f_lineno  # the site's line: this one
    entry, seq, *rest, site, entered, ended = _SLOT.unpack_from(segment, at)
    assert (entry, seq, tuple(rest), ended) == (1, 7, CALL, 0)
    assert strings.text(site) == f"test_flight_writer.py:{line} in test_slot_holds_the_call_and_the_first_outside_frame"
    assert entered > 0 and writer.entries == 1
    writer.end(at)
    assert _SLOT.unpack_from(segment, at)[10] >= entered
    writer.fail(at)
    assert _SLOT.unpack_from(segment, at)[10] <= -entered


def test_a_site_is_taught_once_and_each_line_is_its_own(setup):
    writer, segment, strings = setup
    sites = []
    for _ in range(3):
        sites.append(_SLOT.unpack_from(segment, outer(writer, 1, CALL))[8])
        sites.append(_SLOT.unpack_from(segment, outer(writer, 2, CALL))[8])
    asked = strings.asked
    assert asked == 2  # two lines, each interned the first time only
    assert sites[0::2] == [sites[0]] * 3 and sites[1::2] == [sites[1]] * 3 and sites[0] != sites[1]
    for _ in range(5):
        outer(writer, 3, CALL)
    assert strings.asked == asked + 1


def test_ring_wraps_by_entry(setup):
    writer, segment, _ = setup
    offsets = [outer(writer, seq, CALL) for seq in range(1, RING + 3)]
    assert offsets[RING] == offsets[0] and len(set(offsets)) == RING
    assert _SLOT.unpack_from(segment, offsets[0])[:2] == (RING + 1, RING + 1)


def test_many_code_objects_overflow_the_tables_and_stay_right(setup):
    """More call sites than the C tables hold (1,024): the teacher serves the rest, correctly."""
    writer, segment, strings = setup
    for i in range(1100):
        scope = {"outer": outer, "writer": writer, "call": CALL}
        exec(compile(f"at = outer(writer, {i}, call)", f"site_{i}.py", "exec"), scope)
        assert strings.text(_SLOT.unpack_from(segment, scope["at"])[8]) == f"site_{i}.py:1 in <module>"


def test_bad_arguments_are_typed_errors(setup):
    writer, _, _ = setup
    with pytest.raises((TypeError, ValueError)):
        writer.enter(1, (1, 2, 3))
    if not isinstance(writer, PyRecorder):
        with pytest.raises(ValueError, match="not the offset of a slot"):
            writer.end(3)


def test_the_c_writer_builds_where_a_compiler_is():
    if not _compiler_here():
        pytest.skip("no C compiler or Python headers here")
    assert native.load("flight_record") is not None


def test_gpucomm_native_0_gives_the_twin(tmp_path):
    code = (
        "import mmap, gpucomm.reliability.flight as f; seg = memoryview(mmap.mmap(-1, f.SEGMENT_BYTES));"
        "w = f.recorder(seg, lambda frame: 0); print(type(w).__name__); w.close(); seg.release()"
    )
    env = {**os.environ, "GPUCOMM_NATIVE": "0", "GPUCOMM_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "PyRecorder"
    assert not any(tmp_path.iterdir())  # nothing compiled


def test_recorder_picks_c_where_it_builds(tmp_path):
    if not _compiler_here():
        pytest.skip("no C compiler or Python headers here")
    code = (
        "import mmap, gpucomm.reliability.flight as f; seg = memoryview(mmap.mmap(-1, f.SEGMENT_BYTES));"
        "w = f.recorder(seg, lambda frame: 0); print(type(w).__name__); w.close(); seg.release()"
    )
    env = {**os.environ, "GPUCOMM_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "Recorder"
    assert [p.suffix for p in (tmp_path / "native").iterdir()] == [".so"]


def test_a_failure_marks_its_own_call_not_the_last_one_entered():
    """An asynchronous call's failure is translated after later calls were entered: it marks the
    slot of its own call number."""
    import torch

    from gpucomm.reliability.flight import FlightLog, FlightRecord

    record = FlightRecord(torch.distributed.HashStore(), "t/", [0], 0, 1, True, 10.0)
    try:
        log = FlightLog(record, "world")
        t = torch.ones(4)
        first = log.entered(1, "all_reduce", t, {"op": "SUM"})
        second = log.entered(2, "broadcast", t, {"root": 0})
        log.failed(1)
        ended = {seq: _SLOT.unpack_from(record._mine, at)[10] for seq, at in ((1, first), (2, second))}
        assert ended[1] < 0 and ended[2] == 0, ended
        log.failed(5)  # a call the ring no longer holds (or never did): nothing to mark
        assert _SLOT.unpack_from(record._mine, second)[10] == 0
    finally:
        record.close()


# A Recorder closed while enter() runs Python code (the walk's teacher, a call field's __index__):
# the points where the GIL can pass to another thread that closes the record. The call must raise
# "closed", not write through the released segment (a NULL pointer then). end() and fail() run no
# Python code between their check and their write (the offset must be an int).
CLOSED_MID_CALL = """
import mmap, sys
from gpucomm.toolchain import native
from gpucomm.reliability.flight import _RING_AT, RING, SEGMENT_BYTES
module = native.load("flight_record", tuple(sys.argv[1:]))
holder = []
def teacher(frame):
    if closing:
        holder[0].close()  # as another thread would, between the call's check and its write
    return 5
class Closing:
    def __index__(self):
        holder[0].close()
        return 6
said = []
for step in ("teacher", "index"):
    closing = step == "teacher"
    segment = memoryview(mmap.mmap(-1, SEGMENT_BYTES))
    holder[:] = [module.Recorder(segment, _RING_AT, RING, teacher)]
    if step == "index":
        holder[0].enter(1, (3, 4, 1024, 5, -1, 6))  # taught: the second call asks no teacher
    try:
        holder[0].enter(2, (3, 4, 1024, 5, -1, Closing() if step == "index" else 6))
    except ValueError as err:
        said.append(f"{step}: {err}")
print("; ".join(said))
"""


@pytest.mark.parametrize("defines", [(), ("GPUCOMM_PUBLIC_FRAMES",)], ids=["c", "c-public"])
def test_a_record_closed_during_a_call_is_never_written_through(defines, tmp_path):
    if not _compiler_here():
        pytest.skip("no C compiler or Python headers here")
    env = {**os.environ, "GPUCOMM_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", CLOSED_MID_CALL, *defines], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, f"the writer crashed (rc {out.returncode}): {out.stderr[-2000:]}"
    assert out.stdout.strip() == "teacher: Recorder: closed; index: Recorder: closed", out.stdout + out.stderr
