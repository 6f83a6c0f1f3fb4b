"""The stream-ordering rule (gpucomm.workspace.stream_order), checked without a GPU: streams and events are
faked by a small model of the device, in which a stream is a sequence of operations and a wait
for another stream depends on that stream's tail at the time of the wait.

- The waits inserted for given sequences of calls: none for a loop of blocking calls on one
  stream; one per change of stream; none during a CUDA graph capture.
- For random sequences of blocking calls, asynchronous calls and uploads from several streams,
  with the caller's own work in between: every launch of the communicator happens after the one
  before it (in the model's happens-before), and an asynchronous call's launch after the work the
  caller queued before the call.
- Which path a call takes, on a communicator made to look like a GPU one (its streams, events and
  current stream faked, the real Triton program kernel under the interpreter): a blocking call
  launches on the caller's current stream, the fast path serving it from the second call on; an
  asynchronous one on the engine's stream; the waits between them as the rule says.
"""

from __future__ import annotations

import random

import pytest
from spawn import run_ranks

from gpucomm.workspace.stream_order import StreamOrder


class _Device:
    """A model of a GPU's streams: operations and their dependencies, nothing run."""

    def __init__(self) -> None:
        self.deps: list[set[int]] = []  # operation -> the operations it directly follows
        self.waits: list[tuple[str, str]] = []  # (waiting stream, waited-for stream) in call order
        self.capturing = False

    def op(self, stream: _Stream, after: int | None = None) -> int:
        deps = {stream.tail} if stream.tail is not None else set()
        if after is not None:
            deps.add(after)
        self.deps.append(deps)
        stream.tail = len(self.deps) - 1
        return stream.tail

    def before(self, a: int, b: int) -> bool:
        """Whether operation ``a`` happens before operation ``b``."""
        seen, todo = set(), [b]
        while todo:
            x = todo.pop()
            for d in self.deps[x]:
                if d == a:
                    return True
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        return False


class _Stream:
    _ids = iter(range(1000, 10**6))

    def __init__(self, model: _Device, name: str) -> None:
        self.model = model
        self.name = name
        self.cuda_stream = next(self._ids)
        self.tail: int | None = None

    def wait_stream(self, other: _Stream) -> None:
        self.model.waits.append((self.name, other.name))
        if other.tail is not None:
            self.model.op(self, after=other.tail)  # an event recorded on other now, waited for here


def _order(device: _Device, engine: _Stream, current: list[_Stream]) -> StreamOrder:
    return StreamOrder(engine, lambda: current[0], lambda: current[0].cuda_stream, lambda: device.capturing)


def _setup(streams: int = 2) -> tuple[_Device, _Stream, list[_Stream], list[_Stream], StreamOrder]:
    device = _Device()
    engine = _Stream(device, "engine")
    callers = [_Stream(device, f"s{i}") for i in range(streams)]
    current = [callers[0]]
    return device, engine, callers, current, _order(device, engine, current)


def _blocking(device: _Device, order: StreamOrder, current: list[_Stream]) -> int:
    assert order.to_caller()
    return device.op(current[0])


def _async(device: _Device, order: StreamOrder, engine: _Stream) -> int:
    order.to_engine()
    return device.op(engine)


def test_a_loop_of_blocking_calls_on_one_stream_waits_for_nothing():
    device, engine, callers, current, order = _setup()
    for _ in range(100):
        _blocking(device, order, current)
        device.op(callers[0])  # the caller's own work in between
    assert device.waits == []


def test_async_then_blocking_waits_for_the_engine_stream_once():
    device, engine, callers, current, order = _setup()
    a = _async(device, order, engine)
    b = _blocking(device, order, current)
    c = _blocking(device, order, current)
    assert device.waits == [("engine", "s0"), ("s0", "engine")]
    assert device.before(a, b) and device.before(b, c)


def test_blocking_then_async_on_the_same_stream_waits_once():
    device, engine, callers, current, order = _setup()
    a = _blocking(device, order, current)
    b = _async(device, order, engine)
    assert device.waits == [("engine", "s0")]  # the wait for the caller's stream covers the launch
    assert device.before(a, b)


def test_blocking_on_another_stream_then_async_waits_for_both():
    device, engine, (s0, s1), current, order = _setup()
    current[0] = s1
    a = _blocking(device, order, current)
    current[0] = s0
    b = _async(device, order, engine)
    assert device.waits == [("engine", "s1"), ("engine", "s0")]
    assert device.before(a, b)


def test_blocking_calls_from_two_streams_in_turn():
    device, engine, (s0, s1), current, order = _setup()
    launches = []
    for k in range(4):
        current[0] = (s0, s1)[k % 2]
        launches.append(_blocking(device, order, current))
        launches.append(_blocking(device, order, current))
    assert device.waits == [("s1", "s0"), ("s0", "s1"), ("s1", "s0")]
    assert all(device.before(x, y) for x, y in zip(launches, launches[1:]))


def test_nothing_is_waited_for_inside_a_capture_but_the_engine_joins_it():
    device, engine, (s0, s1), current, order = _setup()
    _async(device, order, engine)
    device.capturing, current[0] = True, s1  # torch.cuda.graph captures on a stream of its own
    assert order.to_caller() is False
    order.to_engine()
    assert device.waits == [("engine", "s0"), ("engine", "s1")]  # the second: joining the capture
    assert order.last is engine  # a captured launch runs at replay time: it is not the last one
    device.capturing, current[0] = False, s0
    assert order.to_caller()
    assert device.waits[-1] == ("s0", "engine")


@pytest.mark.parametrize("seed", range(20))
def test_random_sequences_keep_every_launch_in_call_order(seed):
    rnd = random.Random(seed)
    device, engine, callers, current, order = _setup(streams=3)
    launches: list[int] = []
    for _ in range(60):
        current[0] = rnd.choice(callers) if rnd.random() < 0.4 else current[0]
        what = rnd.choice(["blocking", "blocking", "async", "upload", "user"])
        if what == "blocking":
            launches.append(_blocking(device, order, current))
        elif what == "async":
            data = device.op(current[0])  # the caller's input, queued before the call
            launch = _async(device, order, engine)
            assert device.before(data, launch), f"seed {seed}: an asynchronous call ran before its input was ready"
            launches.append(launch)
        elif what == "upload":  # Engine.upload: a copy on the engine stream, then a launch on the caller's
            order.to_engine()
            copy = device.op(engine)
            order.to_caller()
            launch = device.op(current[0])
            assert device.before(copy, launch)
            launches.append(launch)
        else:
            device.op(current[0])
    for k, (x, y) in enumerate(zip(launches, launches[1:])):
        assert device.before(x, y), f"seed {seed}: launch {k + 1} may run before launch {k} has ended"


def _paths(rank: int, world_size: int) -> dict:
    """A blocking, fast-path and asynchronous mix on a communicator whose engine looks like a GPU
    one: the stream of each launch, the waits, the full-path calls, the results."""
    import contextlib

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    import gpucomm
    from gpucomm.comm.communicator import Communicator

    device = _Device()
    s0, s1, engine_stream = _Stream(device, "s0"), _Stream(device, "s1"), _Stream(device, "engine")
    current = [s0]
    for s in (s0, s1, engine_stream):
        s.device = torch.device("cpu")  # what StreamEnd asks
        s.wait_event = lambda event, s=s: device.waits.append((s.name, f"event of {event.stream.name}"))

    class Event:
        def record(self, stream=None):
            self.stream = stream if stream is not None else current[0]

        def query(self):
            return True

    @contextlib.contextmanager
    def on(stream):
        saved, current[0] = current[0], stream
        try:
            yield
        finally:
            current[0] = saved

    torch.cuda.stream = on
    torch.cuda.Event = Event
    torch.cuda.current_stream = lambda device=None: current[0]
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.device = lambda device: contextlib.nullcontext()
    torch._C._cuda_getDevice = lambda: None  # the CPU device's index: this device is current

    streams = []
    original = InterpretedFunction.run

    def run(fn, *args, **kwargs):  # noqa: ANN001, ANN202 (Triton's signature)
        streams.append(current[0].name)
        return original(fn, *args, **kwargs)

    InterpretedFunction.run = run
    full = []
    original_route = Communicator._route

    def counted(self, call):  # noqa: ANN001, ANN202
        full.append(call.fn)
        return original_route(self, call)

    Communicator._route = counted

    gpucomm.init_process_group(transport="shm", kernels="triton", workspace_bytes="64K", timeout=60)
    comm = gpucomm.get_default_communicator()
    engine = comm._engines["cpu"]
    engine.stream, engine.side_stream = engine_stream, _Stream(device, "side")
    engine.order = _order(device, engine_stream, current)
    # Launches go through the GPU's steps (the device context faked): on a GPU a bound launch takes
    # the raw handle of the stream current at the call (gpucomm.ops.launcher's Bound.launch).
    executor = engine.executor
    executor._on_gpu = True
    executor._stream = lambda: current[0].cuda_stream
    prepare = executor.kernels.prepare_program

    class Bound:
        def __init__(self, launch):
            self.run = launch

        def launch(self, stream):
            if stream != current[0].cuda_stream:
                raise AssertionError(f"launched on stream handle {stream}, the current stream is {current[0].name}")
            self.run()

    executor.kernels.prepare_program = lambda *args, **kwargs: Bound(prepare(*args, **kwargs))

    t, u = torch.empty(8), torch.empty(8)
    values = []
    steps = []

    def step(name, call):
        before_waits, before_launches = len(device.waits), len(streams)
        call()
        steps.append((name, streams[before_launches:], device.waits[before_waits:]))

    t.fill_(rank + 1)
    step("blocking", lambda: comm.all_reduce(t))
    values.append(t[0].item())
    t.fill_(rank + 1)
    step("blocking again", lambda: comm.all_reduce(t))
    values.append(t[0].item())
    u.fill_(rank + 1)
    step("async", lambda: comm.all_reduce(u, async_op=True).wait())
    values.append(u[0].item())
    t.fill_(rank + 1)
    step("blocking after async", lambda: comm.all_reduce(t))
    values.append(t[0].item())
    current[0] = s1
    t.fill_(rank + 1)
    step("blocking on another stream", lambda: comm.all_reduce(t))
    values.append(t[0].item())
    current[0] = s0
    u.fill_(rank + 1)
    step("async after blocking on another stream", lambda: comm.all_reduce(u, async_op=True).wait())
    values.append(u[0].item())
    gpucomm.destroy_process_group()
    return {"steps": steps, "full": full, "values": values}


def test_blocking_calls_launch_on_the_callers_stream_and_async_ones_on_the_engines():
    for result in run_ranks(_paths, 2, env={"TRITON_INTERPRET": "1"}, timeout=300):
        assert result["values"] == [3.0] * 6
        # The full path served the first blocking call and the asynchronous ones; the fast path
        # served the repeated blocking calls, whatever the stream.
        assert result["full"] == ["all_reduce", "all_reduce", "all_reduce"], result["full"]
        assert result["steps"] == [
            ("blocking", ["s0"], []),
            ("blocking again", ["s0"], []),
            ("async", ["engine"], [("engine", "s0"), ("s0", "event of engine")]),
            ("blocking after async", ["s0"], [("s0", "engine")]),
            ("blocking on another stream", ["s1"], [("s1", "s0")]),
            (
                "async after blocking on another stream",
                ["engine"],
                [("engine", "s1"), ("engine", "s0"), ("s0", "event of engine")],
            ),
        ], result["steps"]
