"""Rendezvous under torchrun's restarts, and the node layout it reads from the environment."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from gpucomm.comm.rendezvous import rendezvous

# One rank's rendezvous through env://, as a worker that torchrun started: its prefix, or its error.
RANK = """
import sys
from gpucomm.comm.rendezvous import rendezvous
try:
    print("PREFIX", rendezvous(None, None, None, None, float(sys.argv[1])).prefix)
except Exception as err:  # noqa: BLE001 - the test reads what the rank ended with
    print("ERROR", type(err).__name__, err)
"""


def _workers(port: int, attempt: int, ranks: list[int], world_size: int, timeout: float = 8.0) -> list[str]:
    """The ranks ``ranks`` of attempt ``attempt``, started together as torchrun's agent starts
    them (its store on ``port``); what each printed."""
    procs = []
    for rank in ranks:
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(timeout)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs]


def test_a_restart_after_a_rank_died_before_arriving_lands_in_one_generation() -> None:
    """Attempt 0: rank 1 dies before it arrives; rank 0 waits for it and gives up, naming it.
    Attempt 1, on the same agent store: both ranks must agree on one prefix, under the attempt's
    own prefix of the store."""
    agent = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    (first,) = _workers(agent.port, 0, [0], 2, timeout=1.0)
    assert first.startswith("ERROR NeverJoinedError") and "rank 1 never joined (1 of 2 arrived" in first, first
    second = _workers(agent.port, 1, [0, 1], 2)
    assert all(line.startswith("PREFIX gpucomm/") for line in second), second
    assert second[0] == second[1], f"attempt 1's ranks drew different prefixes: {second}"
    assert agent.check(["/worker/attempt_1/gpucomm/w2/gen0/record"])  # met under the attempt's own prefix


def test_ranks_on_several_nodes_keep_one_count(monkeypatch) -> None:
    """Across nodes each agent counts its own restarts (one that restarts for a peer node's
    failure adds nothing), so their attempt numbers can differ: the ranks must not be split by
    them. Rank 0 says restart 1, rank 1 says restart 0, LOCAL_WORLD_SIZE 1 of 2: one prefix."""
    agent = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    procs = []
    for rank, attempt in ((0, 1), (1, 0)):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(agent.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(attempt),
        }
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, "8"], env=env, stdout=subprocess.PIPE, text=True))
    lines = [p.communicate(timeout=120)[0].strip().splitlines()[-1] for p in procs]
    assert lines[0] == lines[1] and lines[0].startswith("PREFIX gpucomm/"), lines


@pytest.mark.parametrize(
    "variables, message",
    [
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE must be >= 1, got 0"),
        ({"LOCAL_WORLD_SIZE": "-2"}, "LOCAL_WORLD_SIZE must be >= 1, got -2"),
        ({"LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE must be an integer, got 'two'"),
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"}, "LOCAL_RANK must be in [0, 2) (LOCAL_WORLD_SIZE), got 2"),
        ({"LOCAL_RANK": "x"}, "LOCAL_RANK must be an integer, got 'x'"),
    ],
)
def test_a_wrong_node_layout_is_a_value_error_naming_the_variable(monkeypatch, variables, message) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="gpucomm.init_process_group: environment variable") as raised:
        rendezvous(None, 0, 2, dist.HashStore(), 5.0)
    assert message in str(raised.value)
