"""gpucomm-bench's out-of-place all_reduce column: the backend's own out-of-place call where it has
one (gpucomm.all_reduce_into), else the caller's copy and the in-place call (torch.distributed, gloo)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gpucomm._bench.buffers import Buffers
from gpucomm._bench.collectives import SPECS, Case

CPU = torch.device("cpu")


def _mod(calls: list[str], into: bool) -> SimpleNamespace:
    """A one-rank backend: all_reduce leaves the tensor, all_reduce_into copies; each call recorded."""

    def all_reduce(tensor: torch.Tensor, op: object = None) -> None:
        calls.append("all_reduce")

    def all_reduce_into(output: torch.Tensor, input: torch.Tensor, op: object = None) -> None:
        calls.append("all_reduce_into")
        output.copy_(input)

    mod = SimpleNamespace(all_reduce=all_reduce, ReduceOp=SimpleNamespace(SUM="sum"))
    if into:
        mod.all_reduce_into = all_reduce_into
    return mod


def _run(into: bool, monkeypatch) -> list[str]:
    """The timed call's steps: the backend's calls, and "copy_" for a copy the bench makes itself."""
    calls: list[str] = []
    case = Case(0, 1, 1024, torch.float32, CPU, "sum", 0, 7, Buffers(CPU, 1 << 16))
    prepared = SPECS["all_reduce"].prepare(case, _mod(calls, into), "sum", False)
    prepared.reset()
    real_copy = torch.Tensor.copy_

    def counting_copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if not calls or calls[-1] != "all_reduce_into":  # not the double's own copy
            calls.append("copy_")
        return real_copy(self, src, non_blocking)

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "copy_", counting_copy)
        prepared.call()
    assert torch.equal(prepared.result.to(torch.float64), prepared.expected().to(torch.float64))
    return calls


def test_gpucomm_times_all_reduce_into_and_gloo_the_copy_then_in_place(monkeypatch) -> None:
    assert _run(True, monkeypatch) == ["all_reduce_into"]
    assert _run(False, monkeypatch) == ["copy_", "all_reduce"]
