"""The knobs every rank of a communicator must share, compared once at init.

A knob that differs between ranks makes them take different paths for the same call: one rank
opens a shared-memory workspace while its peer connects gloo, and both wait in the store until
the timeout ends in a raw ``DistStoreError`` naming a key. So at init each rank publishes the
knobs below under the communicator's prefix, reads every rank's, and where any differ every rank
raises the same :class:`~gpucomm.errors.KnobMismatchError` naming each rank's value.

The channel count is agreed separately, when the workspace opens (gpucomm.workspace.channels);
``debug``, ``status_signal`` and ``blocking_wait`` are each rank's own business.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import torch.distributed as dist

from gpucomm.comm.arrivals import store_wait
from gpucomm.config import Config
from gpucomm.errors import KnobMismatchError

__all__ = ["AGREED", "agree"]

# The knobs that must be equal on every rank (issue: transport, kernels, algorithm, workspace
# and heap sizes, timeout, check mode).
# How long rank 0 waits for the others to read the knobs before it raises (they read right after
# their wait ends; 2 s leaves room on a loaded 2-core host).
_READ_S = 2.0
AGREED = ("transport", "kernels", "algo", "workspace_bytes", "heap_bytes", "timeout", "check")


def agree(
    store: dist.Store,
    prefix: str,
    config: Config,
    rank: int,
    world_size: int,
    fn: str,
    global_ranks: Sequence[int],
) -> None:
    """Publish this rank's :data:`AGREED` knobs and compare them with every rank's (collective).

    Raises:
        KnobMismatchError: some knob differs; every rank raises it, with the same message.
        CommTimeoutError: a rank never published its knobs within the timeout.
    """
    mine = {name: getattr(config, name) for name in AGREED}
    keys = [f"{prefix}knobs/{r}" for r in range(world_size)]
    store.set(keys[rank], json.dumps(mine))
    store_wait(store, keys, config.timeout, op=fn, rank=rank, waited_ranks=list(range(world_size)))
    values = [json.loads(store.get(key)) for key in keys]  # get, not multi_get: a Python Store may lack it
    differ = {name: [v[name] for v in values] for name in AGREED if len({json.dumps(v[name]) for v in values}) > 1}
    if differ:
        _read_by_all(store, prefix, rank, world_size)
        said = "; ".join(_each_rank(name, seen, global_ranks) for name, seen in differ.items())
        names = ", ".join(f"GPUCOMM_{name.upper()}" for name in differ)
        raise KnobMismatchError(
            f"gpucomm.{fn}: the ranks disagree on knobs that must be the same on every rank: {said}. "
            f"Set {names} (or the keywords of init_process_group) alike on every rank",
            knobs=differ,
            rank=rank,
        )


def _read_by_all(store: dist.Store, prefix: str, rank: int, world_size: int) -> None:
    """Before raising, rank 0 (which serves the store outside torchrun) waits briefly for every
    rank to have read the knobs: its exit would cut a slower rank's read short with a raw
    ``DistNetworkError``."""
    keys = [f"{prefix}knobs/read/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    end = time.monotonic() + _READ_S
    while rank == 0 and not store.check(keys) and time.monotonic() < end:
        time.sleep(0.02)


def _each_rank(name: str, seen: list[object], global_ranks: Sequence[int]) -> str:
    """``transport: 'auto' on rank(s) [0, 2], 'gloo' on rank(s) [1]`` (global ranks)."""
    by_value: dict[str, list[int]] = {}
    for r, value in enumerate(seen):
        by_value.setdefault(repr(_shown(name, value)), []).append(global_ranks[r])
    return f"{name}: " + ", ".join(f"{value} on rank(s) {ranks}" for value, ranks in by_value.items())


def _shown(name: str, value: object) -> object:
    """A knob's value as a user sets it: -1 sizes are the device's default."""
    if name in ("workspace_bytes", "heap_bytes") and value == -1:
        return "default"
    return value
