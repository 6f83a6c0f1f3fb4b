"""Rendezvous: the ``torch.distributed.Store`` every gpucomm group keeps its keys in.

``env://`` (torchrun's variables), ``tcp://host:port``, ``file://path`` or a store passed in.
Each init of the world meets in a fresh *generation* of the store, where rank 0 draws a random job
token once every rank has arrived (:mod:`gpucomm.comm.arrivals`); every key gpucomm writes lives under
``gpucomm/<token>/`` (and a subgroup's under ``gpucomm/<token>/g<n>/``), so two inits, two groups
or two jobs sharing a store never read each other's handles.

Under torchrun the store is the elastic agent's, which outlives a restart of the workers: what
attempt 0 wrote (the arrivals of its ranks, one short where a rank died before arriving) is there
for attempt 1. On one node gpucomm keeps each attempt's keys under ``/worker/attempt_<N>/``
(``TORCHELASTIC_RESTART_COUNT``), as torch's env:// rendezvous did for the agent store up to
torch 2.4 (:func:`_agent_attempt_store` says why not across nodes).
"""

from __future__ import annotations

import datetime
import errno
import os
import socket
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from gpucomm.comm.arrivals import draw_prefix, store_wait
from gpucomm.errors import NeverJoinedError

__all__ = ["Rendezvous", "rendezvous", "draw_prefix", "store_wait"]


@dataclass(frozen=True)
class Rendezvous:
    store: dist.Store  # the root store, shared by every group of this init
    prefix: str  # this init's key prefix, ends with "/"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _env_int(name: str, fn: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is not None:
            return default
        raise ValueError(
            f"gpucomm.{fn}: environment variable {name} is not set (init_method='env://' reads RANK, WORLD_SIZE, "
            "MASTER_ADDR, MASTER_PORT)"
        )
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"gpucomm.{fn}: environment variable {name} must be an integer, got {value!r}") from None


def _local_layout(rank: int, world_size: int, fn: str) -> tuple[int, int]:
    """(local_rank, local_world_size) from LOCAL_RANK and LOCAL_WORLD_SIZE (defaults: one node)."""
    local_world_size = _env_int("LOCAL_WORLD_SIZE", fn, world_size)
    if local_world_size < 1:
        raise ValueError(f"gpucomm.{fn}: environment variable LOCAL_WORLD_SIZE must be >= 1, got {local_world_size}")
    local_rank = _env_int("LOCAL_RANK", fn, rank % local_world_size)
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"gpucomm.{fn}: environment variable LOCAL_RANK must be in [0, {local_world_size}) (LOCAL_WORLD_SIZE), "
            f"got {local_rank}"
        )
    return local_rank, local_world_size


# One TCPStore per (host, port) for the life of the process. Re-creating it on every init
# would race: a rank that starts its next init while rank 0 still tears down the previous
# server connects to the dying one. Each init draws a fresh generation from the same store.
_TCP_STORES: dict[tuple[str, int], dist.Store] = {}


def release_stores() -> None:
    """Drop the process's TCPStores (at exit, once every group built on them is closed), so that
    their server threads stop while the interpreter is whole."""
    _TCP_STORES.clear()


def _tcp_store(host: str, port: int, rank: int, world_size: int, timeout: float, fn: str) -> dist.Store:
    store = _TCP_STORES.get((host, port))
    if store is None:
        store = _TCP_STORES[(host, port)] = _new_tcp_store(host, port, rank, world_size, timeout, fn)
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store


def _new_tcp_store(host: str, port: int, rank: int, world_size: int, timeout: float, fn: str) -> dist.Store:
    # Under torchrun the elastic agent already serves a store on MASTER_PORT: join it as a client.
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    serve = rank == 0 and not agent_serves
    try:
        return _connect(host, port, world_size, serve, timeout)
    except dist.DistNetworkError as err:
        if serve or agent_serves:
            raise
        # Nobody served the store within the timeout: rank 0, which serves it, never came (TCPStore's
        # own error names only a socket).
        raise NeverJoinedError(fn, rank, [0], world_size, timeout, store_at=f"{host}:{port}") from err


def _connect(host: str, port: int, world_size: int, serve: bool, timeout: float) -> dist.Store:
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=serve,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        # multi_tenant: torch.distributed's own env:// store on the same port shares this server,
        # so gpucomm and torch.distributed.init_process_group run side by side in one process.
        multi_tenant=True,
        master_listen_fd=_listen(host, port) if serve else None,
    )


def _listen(host: str, port: int) -> int | None:
    """A socket listening on ``host`` only: TCPStore by itself would listen on every interface.

    None when the port is taken: torch.distributed's multi-tenant store of this very process
    (initialised first) then serves it, or TCPStore reports the conflict itself.
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            return None
        raise OSError(
            err.errno, f"gpucomm: cannot serve the rendezvous store on {host}:{port}: {err.strerror}"
        ) from err
    return sock.detach()  # the TCPStore owns the descriptor from here on


def rendezvous(
    init_method: str | None,
    rank: int | None,
    world_size: int | None,
    store: dist.Store | None,
    timeout: float,
    fn: str = "init_process_group",
    global_ranks: Sequence[int] | None = None,
) -> Rendezvous:
    """Resolve rank, world size, node layout and the store; draw this init's prefix (collective:
    every rank arrives, or each raises by ``timeout``; ``fn`` and ``global_ranks`` for its error)."""
    if store is not None and init_method is not None:
        raise ValueError(f"gpucomm.{fn}: pass either store= or init_method=, not both")
    url = urllib.parse.urlparse(init_method or "env://")
    if store is not None and (rank is None or world_size is None):
        # torch.distributed's rule too: a store carries no rank, so RANK and WORLD_SIZE are not read for it.
        missing = " and ".join(name for name, v in (("rank=", rank), ("world_size=", world_size)) if v is None)
        raise ValueError(
            f"gpucomm.{fn}: store= was passed without {missing}: pass rank= and world_size= with store= "
            "(a store does not say which rank this process is)"
        )
    if rank is None:
        rank = _env_int("RANK", fn)
    if world_size is None:
        world_size = _env_int("WORLD_SIZE", fn)
    if world_size < 1:
        raise ValueError(f"gpucomm.{fn}: world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"gpucomm.{fn}: rank must be in [0, {world_size}), got {rank}")
    local_rank, local_world_size = _local_layout(rank, world_size, fn)

    if store is None:
        if url.scheme == "env":
            # Loopback unless the job says otherwise: the store never listens on 0.0.0.0 by default.
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            store = _tcp_store(host, _env_int("MASTER_PORT", fn), rank, world_size, timeout, fn)
            store = _agent_attempt_store(store, world_size, local_world_size, fn)
        elif url.scheme == "tcp":
            if not url.hostname or not url.port:
                raise ValueError(f"gpucomm.{fn}: init_method must look like tcp://host:port, got {init_method!r}")
            store = _tcp_store(url.hostname, url.port, rank, world_size, timeout, fn)
        elif url.scheme == "file":
            path = url.path or url.netloc
            store = dist.FileStore(path, world_size)
            store.set_timeout(datetime.timedelta(seconds=timeout))
        else:
            store, rank, world_size = _registered(init_method, rank, world_size, timeout, fn)
    prefix = draw_prefix(store, rank, world_size, timeout, fn, global_ranks)
    return Rendezvous(store, prefix, rank, world_size, local_rank, local_world_size)


def _agent_attempt_store(store: dist.Store, world_size: int, local_world_size: int, fn: str) -> dist.Store:
    """The torchrun agent's store under this attempt's prefix (``/worker/attempt_<N>``), where
    the job runs on one node; ``store`` itself elsewhere.

    The agent's store outlives a restart (torch 2.13's dynamic rendezvous keeps its shared
    TCPStore server for every round), so without a prefix attempt 1 meets where attempt 0's ranks
    left their arrivals: rank 0 of attempt 1 can take the arrival of a rank killed while it waited
    for that rank's own, and go on without the new process. Under this prefix each attempt starts
    from an empty store. torch's env:// rendezvous put the agent store under this prefix up to torch 2.4.
    It dropped it (torch/distributed/rendezvous.py, pytorch issue #135712) because
    TORCHELASTIC_RESTART_COUNT is each agent's own count: an agent that restarts its workers for
    a peer node's failure or a new node does not add to it, so across nodes the prefixes can
    differ and the ranks would never meet. One node has one agent, hence one count for every rank.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True) or local_world_size != world_size:
        return store
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT", fn, 0)
    return dist.PrefixStore(f"/worker/attempt_{attempt}", store)


def _registered(init_method: str, rank: int, world_size: int, timeout: float, fn: str) -> tuple[dist.Store, int, int]:
    """The store, rank and world size of a scheme registered with
    ``torch.distributed.register_rendezvous_handler`` (``gpucomm.register_rendezvous_handler`` is
    that function): torch's rendezvous runs the handler."""
    try:
        return next(dist.rendezvous(init_method, rank, world_size, timeout=datetime.timedelta(seconds=timeout)))
    except RuntimeError as err:
        if "No rendezvous handler" not in str(err):
            raise
    raise ValueError(
        f"gpucomm.{fn}: init_method must be env://, tcp://host:port, file://path or a scheme registered with "
        f"register_rendezvous_handler, got {init_method!r}"
    )
