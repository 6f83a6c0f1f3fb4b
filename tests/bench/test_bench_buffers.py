"""gpucomm-bench's buffers: allocated once per rank and reused by every size, round, backend and
variant, as nccl-tests' sendbuff and recvbuff are (bench/buffers.py), counted."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from gpucomm._bench import runner
from gpucomm._bench.backends import Backend
from gpucomm._bench.buffers import Buffers
from gpucomm._bench.collectives import SPECS, Case
from gpucomm._bench.progress import progress_bar
from gpucomm._bench.runner import Settings

CPU = torch.device("cpu")


def test_views_of_one_allocation_per_role_until_a_row_outgrows_it():
    buffers = Buffers(CPU, 4096)
    assert buffers.allocations == 2
    first = buffers.addresses()
    small = buffers.take("send", 10, torch.float32)
    whole = buffers.take("send", 1024, torch.float32)
    halves = buffers.take("recv", 2048, torch.bfloat16)
    assert (small.numel(), whole.numel(), halves.dtype) == (10, 1024, torch.bfloat16)
    assert small.data_ptr() == whole.data_ptr() == first["send"] and halves.data_ptr() == first["recv"]
    assert buffers.allocations == 2 and buffers.addresses() == first
    bigger = buffers.take("recv", 2048, torch.float32)  # 8 KiB: more than reserved
    assert bigger.numel() == 2048 and buffers.allocations == 3
    assert buffers.addresses()["send"] == first["send"]


def test_bad_roles_and_sizes_are_refused_by_name():
    buffers = Buffers(CPU)
    with pytest.raises(ValueError, match=r"Buffers.take: expected a role in \('send', 'recv'\), got 'out'"):
        buffers.take("out", 1, torch.float32)
    with pytest.raises(ValueError, match=r"Buffers.take: expected numel >= 0, got -1"):
        buffers.take("send", -1, torch.float32)
    with pytest.raises(ValueError, match=r"Buffers: expected reserve_bytes >= 0, got -8"):
        Buffers(CPU, -8)


def _settings(rounds: int) -> Settings:
    return Settings(
        collectives=["all_reduce"],
        sizes=[8],
        dtype="float",
        op="sum",
        root=0,
        iters=3,
        warmup=1,
        check=True,
        backends=["a", "b"],
        knobs={},
        device="cpu",
        timeout_s=None,
        seed=1,
        json_path=None,
        plot_path=None,
        rounds=rounds,
    )


def _one_rank_backend(name: str, calls: list[tuple[str, int, int]]) -> Backend:
    """A backend of one rank (all_reduce leaves the tensor as it is) that records each call's buffer."""

    def all_reduce(tensor: torch.Tensor, op: object = None) -> None:
        calls.append((name, tensor.data_ptr(), tensor.numel()))

    mod = SimpleNamespace(all_reduce=all_reduce, barrier=lambda: None, ReduceOp=SimpleNamespace(SUM="sum"))
    return Backend(name, mod)


def test_every_round_and_backend_times_the_same_buffers_prepared_once_per_size():
    """Two backends, three rounds, two sizes: each backend's variants are prepared once per size, no
    buffer is allocated after the first two, and every timed and checked call works on the receive
    buffer; the checks still pass."""
    spec, calls, prepared = SPECS["all_reduce"], [], []

    def counting_prepare(case, mod, op, inplace):
        prepared.append((case.count, inplace))
        return SPECS["all_reduce"].prepare(case, mod, op, inplace)

    spec = dataclasses.replace(spec, prepare=counting_prepare)
    backends = [_one_rank_backend(name, calls) for name in ("a", "b")]
    buffers = Buffers(CPU, 1 << 18)
    for count in (1024, 65536):
        case = Case(0, 1, count, torch.float32, CPU, "sum", 0, 7, buffers)
        results = runner._measure_rounds(spec, case, backends, _settings(3), progress_bar(6, False))
        for name in ("a", "b"):
            rounds = results[name]["rounds"]
            assert len(rounds) == 3
            assert all(cell["wrong"] == 0 for cells in rounds for cell in cells.values())
    assert buffers.allocations == 2
    assert sorted(prepared) == sorted((c, inplace) for c in (1024, 65536) for _ in "ab" for inplace in (False, True))
    # warmup 1 + iters 3 + the check: 5 calls per variant, 2 variants, 3 rounds, 2 backends, 2 sizes.
    assert len(calls) == 5 * 2 * 3 * 2 * 2
    assert {ptr for _, ptr, _ in calls} == {buffers.addresses()["recv"]}
