"""The small all_reduce inside a CUDA graph capture: a shape that already ran eagerly on the tensor
is the launch that call packed; a first call of a shape is refused with the program path's advice
(run it once eagerly first), before anything is compiled or loaded mid-capture.

No GPU here: whether the caller captures is stood in for, and the engine is the few attributes the
small path reads."""

from __future__ import annotations

import types

import pytest
import torch

from gpucomm.errors import UnsupportedError
from gpucomm.reduce_op import ReduceOp
from gpucomm.workspace import small


class _Workspace:
    def data(self, rank: int, nbytes: int, half: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(addr=0x10000 * (rank + 1))

    def flag(self, rank: int, index: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(addr=0x100000 + 0x1000 * rank)


def _small_path(monkeypatch, captures: list[bool]) -> tuple[small.SmallAllReduce, list]:
    engine = types.SimpleNamespace(
        kernels=types.SimpleNamespace(name="triton"),
        world_size=2,
        workspace=_Workspace(),
        p2p_bytes=1 << 16,
        half_bytes=1 << 16,
        device=torch.device("cpu"),
        caller=None,  # the caller's dtype is the wire's
    )
    path = small.SmallAllReduce(engine)
    packed: list = []
    monkeypatch.setattr(small, "capturing", lambda device: captures[-1])
    monkeypatch.setattr(
        path, "_prepare", lambda tensor, op, caller: packed.append((tensor.numel(), op)) or (lambda: None)
    )
    return path, packed


def test_a_first_small_call_inside_a_capture_is_refused_before_anything_is_packed(monkeypatch) -> None:
    path, packed = _small_path(monkeypatch, [True])
    with pytest.raises(UnsupportedError, match=r"has not run outside a CUDA graph.*run the same call once eagerly"):
        path.bind(torch.ones(4), ReduceOp.SUM)
    assert packed == []


def test_a_small_call_captured_after_an_eager_one_is_the_launch_that_call_packed(monkeypatch) -> None:
    captures = [False]
    path, packed = _small_path(monkeypatch, captures)
    t = torch.ones(4)
    eager = path.bind(t, ReduceOp.SUM)
    captures.append(True)
    assert path.bind(t, ReduceOp.SUM) is eager
    assert packed == [(4, ReduceOp.SUM)]
