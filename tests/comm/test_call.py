"""The seam between the communicator and its paths: the Call record, the Path protocol, and a
Work built with its hooks."""

from __future__ import annotations

import inspect

import torch

from gpucomm.comm.call import Call, sent_as
from gpucomm.comm.path import Path
from gpucomm.gloo.checked import CheckedGloo
from gpucomm.gloo.fallback import GlooFallback
from gpucomm.work import Work
from gpucomm.workspace.path import EnginePath


def _serve(path: Path) -> Work:
    return Work()


def test_a_calls_fingerprint_covers_its_options_dtype_and_count_but_all_to_alls_count() -> None:
    t = torch.zeros(4)
    same = Call("all_reduce", t, _serve, fields={"op": "SUM"}).fingerprint()
    assert Call("all_reduce", torch.ones(4), _serve, fields={"op": "SUM"}).fingerprint() == same
    assert Call("all_reduce", t, _serve, fields={"op": "MAX"}).fingerprint() != same
    assert Call("all_reduce", torch.zeros(5), _serve, fields={"op": "SUM"}).fingerprint() != same
    assert Call("all_reduce", t.double(), _serve, fields={"op": "SUM"}).fingerprint() != same
    uneven = Call("all_to_all", t, _serve).fingerprint()
    assert Call("all_to_all", torch.zeros(9), _serve).fingerprint() == uneven


def test_a_send_names_its_peer_and_a_collective_none() -> None:
    t = torch.zeros(1)
    assert Call("isend", t, _serve, fields={"peer": 3, "tag": 0}).peer == 3
    assert Call("isend", t, _serve).point_to_point
    assert Call("broadcast", t, _serve, fields={"root": 3}).peer is None
    assert sent_as(torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)) == {"user_dtype": "bfloat16"}
    assert sent_as(t, t) == {}


def test_every_path_has_every_method_of_the_protocol_with_its_arguments() -> None:
    wanted = {
        name: list(inspect.signature(fn).parameters)
        for name, fn in vars(Path).items()
        if callable(fn) and not name.startswith("_")
    }
    assert "all_reduce" in wanted and "barrier" in wanted
    for path in (EnginePath, GlooFallback, CheckedGloo):
        for name, params in wanted.items():
            assert list(inspect.signature(getattr(path, name)).parameters) == params, (path.__name__, name)


def test_a_work_takes_its_hooks_in_its_constructor() -> None:
    out = torch.arange(3)
    inner = Work(source=2)
    work = Work([inner], outputs=[out], blocking=True)
    assert work.result()[0] is out and work.blocking
    assert work.source == 2  # read through the Work it waited on
    learned = Work()
    learned.source = 5  # a recv's finish step, once the sender is known
    assert Work([learned]).source == 5
