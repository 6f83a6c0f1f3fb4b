"""The communicator and the engine fill the roles the modules below them read them by
(gpucomm/roles.py, and the roles of single modules): each has every attribute its role names,
so a role cannot drift from the object it stands for."""

from __future__ import annotations

import pytest
from spawn import run_ranks


def _roles_filled(rank: int, world_size: int, kernels: str) -> list[str]:
    import gpucomm
    from gpucomm import roles
    from gpucomm.algorithms import across_nodes, hierarchical, p2p
    from gpucomm.language.context import DeviceWorkspace, SymmetricRegion
    from gpucomm.workspace.device_executor import DeviceEngine, DeviceExecutor
    from gpucomm.workspace.host_executor import HostEngine, HostExecutor, Mail
    from gpucomm.workspace.repeat import Repeatable

    gpucomm.init_process_group(transport="shm", kernels=kernels)
    comm = gpucomm.get_default_communicator()
    engine = comm._engines["cpu"]
    executor, role = (HostExecutor, HostEngine) if kernels == "torch" else (DeviceExecutor, DeviceEngine)
    fillers = [
        (comm, roles.Ranks), (comm, roles.Group),
        (engine, roles.NodeWorkspace), (engine, role), (engine, p2p.MailEngine),
        (engine, hierarchical.NodeEngine), (engine, across_nodes.SpanningEngine),
        (engine, Repeatable), (engine.flags, roles.FlagWords),
        (engine.mail, Mail), (engine.topology, hierarchical.Placement),
        (engine, DeviceWorkspace), (comm.heap("cpu"), SymmetricRegion),  # heap(): opens it
    ]  # fmt: skip
    unfilled = [f"{type(obj).__name__} as {role.__name__}" for obj, role in fillers if not isinstance(obj, role)]
    if not isinstance(engine.executor, executor):
        unfilled.append(f"kernels={kernels} ran {type(engine.executor).__name__}, not {executor.__name__}")
    gpucomm.destroy_process_group()
    return unfilled


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_communicator_and_the_engine_fill_their_roles(kernels: str) -> None:
    env = {"TRITON_INTERPRET": "1"} if kernels == "triton" else None
    assert run_ranks(_roles_filled, 1, kernels, env=env) == [[]]
