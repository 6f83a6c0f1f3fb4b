"""Every public function and class of torch.distributed is reachable under ``gpucomm``, with
torch's meaning.

The rule, walked over ``dir(torch.distributed)`` as torch has it here:

- every name without a leading underscore that is a function or a class (``inspect.isroutine``
  or ``inspect.isclass``; torch 2.13 has 95 of them) must be an attribute of
  gpucomm, and be either torch's own object (where gpucomm adds nothing) or gpucomm's own with
  torch's signature (where a call makes, uses or describes groups and backends);
- of the other values, the constants and type aliases (``default_pg_timeout``, ``RankType``,
  ``GroupName``) are torch's own objects; modules are not part of the API (gpucomm's own
  submodules take some of their names: ``config``, ``log``, ``algorithms``), and neither is the
  deprecated ``reduce_op`` instance (``gpucomm.reduce_op`` is the module of ``ReduceOp``);
- the names listed in OURS must be gpucomm's, those in TORCHS torch's objects.
"""

from __future__ import annotations

import inspect
import types

import torch
import torch.distributed as tdist
from torch_signatures import shapes, torch_has

import gpucomm

# Calls that make, find or describe groups and backends: gpucomm's own.
OURS = {
    "init_process_group", "destroy_process_group", "new_group", "new_subgroups", "new_subgroups_by_enumeration",
    "split_group", "shrink_group", "init_device_mesh", "get_node_local_rank", "is_backend_available",
    "is_mpi_available", "is_ucc_available", "is_xccl_available", "is_nccl_available", "get_backend",
    "get_backend_config", "get_default_backend_for_device", "breakpoint", "get_rank", "get_world_size",
    "is_initialized", "all_reduce", "barrier", "monitored_barrier", "batch_isend_irecv", "P2POp", "ReduceOp", "Work",
}  # fmt: skip
# Where gpucomm adds nothing: torch's objects, so that isinstance and except clauses match.
TORCHS = {
    "DistError", "DistBackendError", "DistNetworkError", "DistStoreError", "QueueEmptyError", "GradBucket",
    "BuiltinCommHookType", "DeviceMesh", "ProcessGroup", "group", "GroupMember", "Backend", "BackendConfig",
    "AllreduceOptions", "AllreduceCoalescedOptions", "AllToAllOptions", "BarrierOptions", "BroadcastOptions",
    "GatherOptions", "ReduceOptions", "ReduceScatterOptions", "ScatterOptions", "Reducer", "Logger",
    "ProcessGroupGloo", "DebugLevel", "timedelta", "Store", "TCPStore", "FileStore", "HashStore", "PrefixStore",
    "get_pg_count", "record_comm", "register_rendezvous_handler", "rendezvous", "get_debug_level",
    "set_debug_level", "set_debug_level_from_env",
}  # fmt: skip
CONSTANTS = ("default_pg_timeout", "RankType", "GroupName")
NOT_API = ("reduce_op", "log")  # a deprecated instance and torch's logger: gpucomm's modules of those names stay


def _torch_names() -> dict[str, object]:
    names = {}
    for name in dir(tdist):
        if name.startswith("_"):
            continue
        value = getattr(tdist, name) if name != "reduce_op" else None  # reading reduce_op warns
        names[name] = value
    return names


def _callables() -> dict[str, object]:
    return {n: v for n, v in _torch_names().items() if inspect.isroutine(v) or inspect.isclass(v)}


def test_every_function_and_class_is_there() -> None:
    names = _callables()
    assert len(names) >= 95, f"torch.distributed has {len(names)} public functions and classes here"
    missing = sorted(n for n in names if not hasattr(gpucomm, n))
    assert not missing, f"gpucomm lacks {len(missing)} of torch.distributed's {len(names)}: {missing}"
    not_exported = sorted(n for n in names if n not in gpucomm.__all__)
    assert not not_exported, f"in gpucomm but not in gpucomm.__all__: {not_exported}"


def test_torchs_object_or_ours_with_torchs_signature() -> None:
    wrong = []
    for name, theirs in _callables().items():
        ours = getattr(gpucomm, name)
        if ours is theirs:
            continue
        module = getattr(ours, "__module__", "") or ""
        if not module.startswith("gpucomm"):
            wrong.append(f"{name}: neither torch's object nor gpucomm's ({ours!r})")
        elif inspect.isroutine(theirs) and shapes(name, ours, theirs)[0] != shapes(name, ours, theirs)[1]:
            wrong.append(f"{name}: signature {shapes(name, ours, theirs)} (gpucomm's, torch's)")
    assert not wrong, "\n".join(wrong)


def test_the_lists_hold() -> None:
    for name in OURS:
        assert getattr(gpucomm, name) is not getattr(tdist, name, None), f"{name} must be gpucomm's own"
    for name in TORCHS:
        if torch_has(name):  # an older torch lacks a few (2.11: record_comm); gpucomm then lacks them too
            assert getattr(gpucomm, name) is getattr(tdist, name), f"{name} must be torch's own object"
        else:
            assert not hasattr(gpucomm, name), f"{name}: torch {torch.__version__} has none, gpucomm must not either"
    for name in CONSTANTS:
        assert getattr(gpucomm, name) is getattr(tdist, name), name
    others = {n for n, v in _torch_names().items() if n not in _callables() and n not in CONSTANTS and n not in NOT_API}
    assert all(isinstance(getattr(tdist, n), types.ModuleType) for n in others), sorted(others)


def test_errors_are_torchs() -> None:
    """A script's ``except dist.DistBackendError`` catches gpucomm's collective failures;
    ``except ValueError`` catches a call before init, as torch's ("Default process group has
    not been initialized"); every gpucomm error is a ``DistError``."""
    assert issubclass(gpucomm.CommTimeoutError, tdist.DistBackendError)
    assert issubclass(gpucomm.CommMismatchError, tdist.DistBackendError)
    assert issubclass(gpucomm.CommBrokenError, tdist.DistBackendError)
    assert issubclass(gpucomm.GpucommError, tdist.DistError)
    assert issubclass(gpucomm.NotInitializedError, ValueError)
    try:
        gpucomm.get_rank()
    except ValueError as err:
        assert "init_process_group" in str(err)
    else:
        raise AssertionError("get_rank before init must raise")


def test_single_process_answers() -> None:
    assert gpucomm.is_backend_available("gpucomm") and not gpucomm.is_backend_available("mpi")
    assert gpucomm.is_backend_available("gloo") == tdist.is_gloo_available()
    assert gpucomm.is_backend_available("cpu:gloo,cuda:nccl") == (
        tdist.is_gloo_available() and gpucomm.is_nccl_available()
    )
    assert not (gpucomm.is_mpi_available() or gpucomm.is_ucc_available() or gpucomm.is_xccl_available())
    assert (
        gpucomm.get_default_backend_for_device("cpu") == gpucomm.get_default_backend_for_device("cuda:0") == "gpucomm"
    )
    try:
        gpucomm.get_default_backend_for_device("xpu")
    except ValueError as err:
        assert "gpucomm serves ['cpu', 'cuda']" in str(err)
    else:
        raise AssertionError("xpu must be refused")
    assert not gpucomm.is_initialized() and gpucomm.group.WORLD is None


def test_the_public_names_are_listed_once() -> None:
    """``gpucomm.__all__`` is the union of the public modules' ``__all__``, each name in one of
    them, and it is exactly what ``import gpucomm`` binds publicly (its submodules aside, and
    ``collect_env``, which the package imports on first use)."""
    from gpucomm import errors
    from gpucomm.distributed import collectives, groups, objects, torch_names, world

    lists = [errors.__all__, world.__all__, groups.__all__, collectives.__all__, objects.__all__, torch_names.__all__]
    listed = [name for names in lists for name in names]
    assert len(listed) == len(set(listed)), sorted(n for n in set(listed) if listed.count(n) > 1)
    assert len(gpucomm.__all__) == len(set(gpucomm.__all__)), "gpucomm.__all__ repeats a name"
    assert set(listed) <= set(gpucomm.__all__)
    bound = {n for n, v in vars(gpucomm).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)}
    assert set(gpucomm.__all__) == bound | {"collect_env"}
    assert callable(gpucomm.collect_env)
