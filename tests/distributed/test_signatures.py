"""``import gpucomm as dist`` offers torch.distributed's public functions with torch's signatures,
maps torch's backend strings, and refuses what it cannot honour with an error saying what to use."""

from __future__ import annotations

import datetime
import inspect

import pytest
import torch
import torch.distributed as tdist
from spawn import run_ranks
from torch_signatures import shape, shapes, torch_has

import gpucomm

# torch.distributed's functions that gpucomm offers; checked below to be in gpucomm.__all__.
FUNCTIONS = [
    "init_process_group", "destroy_process_group", "is_available", "is_initialized", "is_gloo_available",
    "is_nccl_available", "is_torchelastic_launched", "get_rank", "get_world_size", "get_backend",
    "get_process_group_ranks", "get_global_rank", "get_group_rank", "new_group", "new_subgroups",
    "new_subgroups_by_enumeration", "send", "recv", "isend", "irecv", "batch_isend_irecv", "broadcast",
    "all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_coalesced",
    "all_gather_into_tensor", "all_gather_single", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "supports_complex", "all_gather_object", "gather_object",
    "broadcast_object_list", "scatter_object_list", "send_object_list", "recv_object_list",
]  # fmt: skip
CLASSES = [
    "ReduceOp",
    "Work",
    "GroupMember",
    "group",
    "P2POp",
    "Backend",
    "ProcessGroup",
    "Store",
    "TCPStore",
    "FileStore",
    "HashStore",
    "PrefixStore",
]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_same_signature_as_torch(name: str) -> None:
    assert name in gpucomm.__all__
    if not torch_has(name):
        pytest.skip(f"torch {torch.__version__} has no {name} (torch 2.13 has)")
    ours, theirs = shapes(name, getattr(gpucomm, name), getattr(tdist, name))
    assert ours == theirs


def test_classes_and_reduce_ops() -> None:
    for name in CLASSES:
        assert name in gpucomm.__all__ and hasattr(gpucomm, name), name
    assert shape(gpucomm.P2POp.__init__) == shape(tdist.P2POp.__init__)
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG", "PREMUL_SUM"):
        assert hasattr(gpucomm.ReduceOp, op), op
    assert gpucomm.GroupMember.WORLD is None and gpucomm.group.WORLD is None  # before init
    for method in ("wait", "is_completed", "is_success", "get_future", "result", "exception"):
        assert callable(getattr(gpucomm.Work, method)), method


def _init_forms(rank: int, world_size: int, path: str) -> dict:
    import gpucomm as dist

    out: dict = {}
    # torch's positional order: backend, init_method, timeout, world_size, rank
    for i, backend in enumerate(("nccl", "cuda:nccl,cpu:gloo", None, "gloo")):
        dist.init_process_group(
            backend, f"file://{path}{i}", datetime.timedelta(seconds=60), world_size, rank, group_name="main"
        )
        t = torch.ones(2)
        dist.all_reduce(t)
        # one world: gpucomm's default group is torch's, wrapping gpucomm's default communicator
        one_world = (
            dist.group.WORLD is tdist.group.WORLD and dist.group.WORLD.communicator is dist.get_default_communicator()
        )
        out[str(backend)] = (t.tolist(), dist.get_backend(), one_world)
        dist.destroy_process_group()
    errors = {}
    for label, call in (
        ("mpi", lambda: dist.init_process_group("mpi")),
        ("cpu device_id", lambda: dist.init_process_group(device_id=torch.device("cpu"))),
        ("pg_options", lambda: dist.init_process_group(pg_options=object())),
    ):
        try:
            call()
        except (ValueError, TypeError) as err:
            errors[label] = str(err)
    dist.init_process_group(init_method=f"file://{path}x", rank=rank, world_size=world_size, timeout=60)
    for label, call in (("barrier timeout", lambda: dist.barrier(timeout=datetime.timedelta(seconds=5))),):
        try:
            call()
        except dist.UnsupportedError as err:
            errors[label] = str(err)
    # use_local_synchronization=True: only the members call (torch's rule); the others get None
    alone = dist.new_group([rank], use_local_synchronization=True)
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t, group=alone)
    out["local sync"] = (
        dist.get_process_group_ranks(alone),
        t.tolist(),
        dist.new_group([0], use_local_synchronization=True) if rank else "member",
    )
    if "sort_ranks" in inspect.signature(tdist.new_group).parameters:
        sub = dist.new_group([1, 0], sort_ranks=False)
        out["unsorted"] = (dist.get_process_group_ranks(sub), dist.get_group_rank(sub, 1), dist.get_global_rank(sub, 1))
    else:  # torch 2.11: its new_group cannot keep the order, and gpucomm says so before any group exists
        try:
            dist.new_group([1, 0], sort_ranks=False)
        except dist.UnsupportedError as err:
            out["unsorted"] = "sort_ranks" in str(err) and torch.__version__ in str(err)
    mine, groups = dist.new_subgroups(1)
    out["subgroups"] = (dist.get_process_group_ranks(mine), len(groups))
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    dist.destroy_process_group()
    out["errors"] = errors
    return out


def test_init_accepts_torch_backends_and_refuses_the_rest(tmp_path) -> None:
    for rank, got in enumerate(run_ranks(_init_forms, 2, str(tmp_path / "store"), timeout=180)):
        # get_backend() says the string passed, as torch's does (README, "The backend string")
        assert got["nccl"] == ([2.0, 2.0], "nccl", True), got
        assert got["cuda:nccl,cpu:gloo"] == ([2.0, 2.0], "cuda:nccl,cpu:gloo", True), got
        assert got["None"] == ([2.0, 2.0], "gpucomm", True), got
        assert got["gloo"] == ([2.0, 2.0], "gloo", True)
        errors = got["errors"]
        assert "backend 'mpi' is not one gpucomm serves; use None or 'gpucomm'" in errors["mpi"]
        assert "device_id must be a CUDA device with an index" in errors["cpu device_id"]
        assert "pg_options must be a gpucomm.distributed.backend.Options" in errors["pg_options"]
        assert (
            "per-call timeout is not supported" in errors["barrier timeout"]
            and "monitored_barrier" in errors["barrier timeout"]
        )
        assert got["local sync"] == ([rank], [rank + 1.0] * 2, None if rank else "member")
        ordered = "sort_ranks" in inspect.signature(tdist.new_group).parameters
        assert got["unsorted"] == (([1, 0], 0, 0) if ordered else True)
        assert got["subgroups"] == ([rank], 2)
