"""What a module reads of an object from a layer above it, as typing Protocols.

gpucomm's folders form layers (docs/architecture.md, "The folders are the layers": from ops and
transport at the bottom through algorithms, workspace and comm up to distributed), and no module
imports one above it, not even for an annotation (tests/test_import_graph.py). Some lower modules
still work with a higher object: the engine reads its communicator's ranks and settings, the
executors and the mailboxes read their engine's layout. They name a role instead of the class: the
few attributes they read. The higher object fills the role by having them (structural typing,
checked by a type checker where it passes itself down), so the lower module never names the class.
The roles several modules share live here; a role only one module reads lives in that module. Each
is runtime-checkable, so that tests/test_roles.py can check that its filler has every attribute it
names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gpucomm.config import Config
from gpucomm.ops.contract import Kernels
from gpucomm.transport.workspace import Workspace

__all__ = ["Ranks", "PeerLiveness", "Group", "FlagWords", "NodeWorkspace"]


@runtime_checkable
class Ranks(Protocol):
    """Who a communicator's members are (:class:`gpucomm.comm.communicator.Communicator`)."""

    rank: int  # this process's rank in the communicator
    world_size: int

    @property
    def global_ranks(self) -> Sequence[int]:
        """The global rank of each member, by communicator rank."""
        ...


@runtime_checkable
class PeerLiveness(Protocol):
    """Where a communicator's ranks run, and which are gone (:class:`gpucomm.reliability.liveness.Liveness`)."""

    def hosts(self) -> list[str]: ...  # every rank's host name, in rank order

    def lost(self, rank: int) -> bool: ...  # rank's process is gone, not after failing a call (on this host)


@runtime_checkable
class Group(Ranks, Protocol):
    """A communicator as its workspace engine sees it: its members, how many share a node,
    where its keys live, its device and its knobs."""

    local_world_size: int
    store: dist.Store
    prefix: str  # every key of this communicator starts with it
    device: torch.device | None  # this rank's GPU, None where there is none
    timeout: float  # seconds
    config: Config
    _liveness: PeerLiveness  # whose processes are gone (gpucomm.reliability.liveness.Liveness)


@runtime_checkable
class FlagWords(Protocol):
    """Indices of the int64 words in a rank's flag area (:class:`gpucomm.workspace.layout.FlagLayout`)."""

    state: int  # the poison word; the channels' epochs follow it
    identity: int  # the first identity slot (the words stored beside each flag)

    def sync_flag(self, channel: int, writer: int) -> int: ...

    def identity_slot(self, parity: int, channel: int, writer: int) -> int: ...

    def epoch(self, channel: int) -> int: ...


@runtime_checkable
class NodeWorkspace(Protocol):
    """One node's workspace as a workspace engine lays it out (:class:`gpucomm.workspace.engine.Engine`),
    for what runs on it: the executors and the send/recv mailboxes."""

    rank: int  # this rank's index on the node
    world_size: int  # ranks on the node
    comm_rank: int  # this rank in the communicator, for errors
    timeout: float  # seconds
    device: torch.device
    kernels: Kernels
    workspace: Workspace
    p2p_bytes: int  # the mailboxes' share of the data area, which the halves follow
    half_bytes: int

    @property
    def members(self) -> Sequence[int]:
        """The communicator rank of each rank on the node, by index on the node."""
        ...
