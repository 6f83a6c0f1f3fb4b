"""Tensors that torch's gloo takes as they are: parameters that require grad, conjugate and
negative views, on the gloo path, the shared-memory path and the Triton program kernel
(interpreted).

- An ``nn.Parameter`` outside ``no_grad`` is written in place on its data, as torch's gloo
  writes it: it stays a leaf that requires grad (before, small reductions on gloo raised
  autograd's RuntimeError from their checked fold).
- ``x.conj()`` and ``torch._neg_view(x)`` are served as the values they stand for, on every
  rank, in and out (gpucomm/comm/lazy_views.py); a broadcast whose root alone passes one gives
  its peers the root's values (before, the root raised torch's RuntimeError and its peers were
  left inside the call: the next call paired with it).
"""

from __future__ import annotations

import pytest
from spawn import run_ranks

PATHS = {
    "gloo": {"GPUCOMM_TRANSPORT": "gloo"},
    "shm": {"GPUCOMM_TRANSPORT": "shm"},
    "triton": {"GPUCOMM_TRANSPORT": "shm", "GPUCOMM_KERNELS": "triton", "TRITON_INTERPRET": "1"},
}
TIMEOUT_S = 10


def _rank_parameters(rank, world_size):
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=TIMEOUT_S)
    base = torch.arange(8.0)
    n = world_size
    cases = {
        "all_reduce MAX": (lambda p: gpucomm.all_reduce(p, op=gpucomm.ReduceOp.MAX), base + n - 1),
        "all_reduce SUM": (lambda p: gpucomm.all_reduce(p), n * base + n * (n - 1) / 2),
        "all_reduce async": (lambda p: gpucomm.all_reduce(p, async_op=True).wait(), n * base + n * (n - 1) / 2),
        "reduce": (lambda p: gpucomm.reduce(p, 0), n * base + n * (n - 1) / 2 if rank == 0 else base + rank),
        "broadcast": (lambda p: gpucomm.broadcast(p, 1), base + 1),
    }
    wrong = []
    for name, (call, expected) in cases.items():
        p = torch.nn.Parameter(base + rank)
        try:
            call(p)
        except Exception as exc:  # noqa: BLE001 - reported per case
            wrong.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        if not (p.requires_grad and p.is_leaf and torch.equal(p.detach(), expected)):
            wrong.append(f"{name}: {p}")
    gpucomm.destroy_process_group()
    return wrong


@pytest.mark.parametrize("path", PATHS)
def test_parameters_that_require_grad_are_reduced_in_place(path):
    for rank, wrong in enumerate(run_ranks(_rank_parameters, 2, env=PATHS[path], timeout=120)):
        assert wrong == [], (rank, wrong)


def _rank_views(rank, world_size):
    import torch

    import gpucomm

    gpucomm.init_process_group(timeout=TIMEOUT_S)
    x = torch.tensor([1 + 2j, 3 - 4j, -5 + 6j]) * (rank + 1)  # rank r holds (r + 1) * x0
    x0 = x / (rank + 1)
    views = {"conj": (torch.conj, torch.conj), "neg": (torch._neg_view, torch.neg)}
    wrong = []
    for kind, (lazy, means) in views.items():

        def check(name, got, expected, kind=kind):
            if not torch.equal(got.resolve_conj().resolve_neg(), expected):
                wrong.append(f"{kind} {name}: {got.tolist()} != {expected.tolist()}")

        t = lazy(x.clone())
        gpucomm.all_reduce(t)
        check("all_reduce", t, means(3 * x0))
        t = lazy(x.clone())
        work = gpucomm.all_reduce(t, async_op=True)
        check("all_reduce async", work.result()[0], means(3 * x0))
        for passes in ((0, 1), (0,), (1,)):  # broadcast from 0; which ranks pass a view
            t = lazy(x.clone()) if rank in passes else x.clone()
            gpucomm.broadcast(t, 0)
            root = means(x0) if 0 in passes else x0
            check(f"broadcast, views on {passes}", t, root)
        outs = [torch.zeros(3, dtype=x.dtype) for _ in range(world_size)]
        gpucomm.all_gather(outs, lazy(x.clone()))
        for r, out in enumerate(outs):
            check(f"all_gather input {r}", out, means((r + 1) * x0))
        outs = [lazy(torch.zeros(3, dtype=x.dtype)) for _ in range(world_size)]
        gpucomm.all_gather(outs, x.clone())
        for r, out in enumerate(outs):
            check(f"all_gather output {r}", out, (r + 1) * x0)
        t = lazy(x.clone()) if rank == 0 else torch.zeros_like(x)
        if rank == 0:
            gpucomm.send(t, 1)
        else:
            gpucomm.recv(t, 0)
        check("send/recv", t, means(x0))
        try:  # a strided view is refused, as a strided plain tensor is, on every rank
            gpucomm.all_reduce(lazy(x.clone())[::2])
            wrong.append(f"{kind}: a strided view was taken")
        except ValueError as exc:
            if "contiguous" not in str(exc):
                wrong.append(f"{kind}: strided view: {exc}")
    gpucomm.destroy_process_group()
    return wrong


@pytest.mark.parametrize("path", PATHS)
def test_conjugate_and_negative_views_are_served_as_their_values(path):
    for rank, wrong in enumerate(run_ranks(_rank_views, 2, env=PATHS[path], timeout=120)):
        assert wrong == [], (rank, wrong)
