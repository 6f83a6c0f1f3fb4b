"""torch.distributed's object collectives on gpucomm: any picklable Python object, as bytes.

Each object is pickled into a uint8 tensor (on ``device``: the CPU by default, or this rank's
GPU), its length travels first as an int64, then the bytes (padded to the longest where a
collective needs equal sizes), and the receivers unpickle. As with torch.distributed,
unpickling runs code chosen by the sender: use these only between processes that trust each
other. Errors name the object call the user made.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from gpucomm.comm.communicator import Communicator
from gpucomm.distributed import lookup

__all__ = [
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
]


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    buffer = io.BytesIO()
    pickle.Pickler(buffer).dump(obj)
    return torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8).to(device)


def _decode(data: torch.Tensor, size: int) -> Any:
    return pickle.loads(data[:size].cpu().numpy().tobytes())


def _device(comm: Communicator, device: torch.device | str | None, fn: str) -> torch.device:
    if device is None:
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device != comm.device:
        raise ValueError(f"gpucomm.{fn}: device {device} is not this rank's device {comm.device}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"gpucomm.{fn}: device must be a cpu or cuda device, got {device}")
    return device


def _list(value: object, fn: str, name: str) -> list:
    if not isinstance(value, list):
        raise TypeError(f"gpucomm.{fn}: {name} must be a list, got {type(value).__name__}")
    return value


def _gathered_bytes(comm: Communicator, mine: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """Every rank's bytes (padded to the longest) and true lengths, by two all_gathers."""
    sizes = torch.empty(comm.world_size, dtype=torch.int64, device=mine.device)
    comm.all_gather_into_tensor(sizes, torch.tensor([mine.numel()], dtype=torch.int64, device=mine.device))
    lengths = sizes.tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8, device=mine.device)
    padded[: mine.numel()] = mine
    outs = [torch.empty_like(padded) for _ in range(comm.world_size)]
    comm.all_gather(outs, padded)
    return outs, lengths


def all_gather_object(object_list: list[Any], obj: Any, group: object = None) -> None:
    """``object_list[i]`` = ``obj`` of rank i, on every rank (``object_list`` has world_size entries)."""
    fn = "all_gather_object"
    comm = lookup.find(group, fn)
    if comm is None:
        return
    if len(_list(object_list, fn, "object_list")) != comm.world_size:
        raise ValueError(
            f"gpucomm.{fn}: object_list must have world_size = {comm.world_size} entries, got {len(object_list)}"
        )
    outs, lengths = _gathered_bytes(comm, _encode(obj, torch.device("cpu")))
    for i, (data, size) in enumerate(zip(outs, lengths)):
        object_list[i] = _decode(data, size)


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: object = None,
    group_dst: int | None = None,
) -> None:
    """``object_gather_list[i]`` on ``dst`` = ``obj`` of rank i; the other ranks pass None."""
    fn = "gather_object"
    comm = lookup.find(group, fn)
    if comm is None:
        return
    root = lookup.group_rank(comm, dst, group_dst, fn, "dst")
    if comm.rank == root:
        if object_gather_list is None or len(_list(object_gather_list, fn, "object_gather_list")) != comm.world_size:
            got = None if object_gather_list is None else len(object_gather_list)
            raise ValueError(
                f"gpucomm.{fn}: object_gather_list must have world_size = {comm.world_size} entries "
                f"on the destination rank, got {got}"
            )
    elif object_gather_list is not None:
        raise ValueError(
            f"gpucomm.{fn}: object_gather_list must be None on rank {comm.rank}, which is not the destination {root}"
        )
    mine = _encode(obj, torch.device("cpu"))
    sizes = torch.empty(comm.world_size, dtype=torch.int64)
    comm.all_gather_into_tensor(sizes, torch.tensor([mine.numel()], dtype=torch.int64))
    lengths = sizes.tolist()
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: mine.numel()] = mine
    outs = [torch.empty_like(padded) for _ in range(comm.world_size)] if comm.rank == root else None
    comm.gather(padded, outs, root)
    if outs is not None:
        for i, (data, size) in enumerate(zip(outs, lengths)):
            object_gather_list[i] = _decode(data, size)  # type: ignore[index]


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: object = None,
    device: torch.device | None = None,
    group_src: int | None = None,
) -> None:
    """Every rank's ``object_list`` (same length everywhere) becomes ``src``'s."""
    fn = "broadcast_object_list"
    comm = lookup.find(group, fn)
    if comm is None:
        return
    root = lookup.group_rank(comm, src, group_src, fn, "src")
    where = _device(comm, device, fn)
    _list(object_list, fn, "object_list")
    encoded = [_encode(o, where) for o in object_list] if comm.rank == root else []
    sizes = torch.tensor([e.numel() for e in encoded] or [0] * len(object_list), dtype=torch.int64, device=where)
    comm.broadcast(sizes, root)
    lengths = sizes.tolist()
    data = torch.cat(encoded) if encoded else torch.empty(sum(lengths), dtype=torch.uint8, device=where)
    comm.broadcast(data, root)
    if comm.rank != root:
        for i, piece in enumerate(data.split(lengths)):
            object_list[i] = _decode(piece, lengths[i])


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: object = None,
    group_src: int | None = None,
) -> None:
    """``scatter_object_output_list[0]`` on rank i = ``scatter_object_input_list[i]`` of ``src``."""
    fn = "scatter_object_list"
    comm = lookup.find(group, fn)
    if comm is None:
        return
    root = lookup.group_rank(comm, src, group_src, fn, "src")
    if len(_list(scatter_object_output_list, fn, "scatter_object_output_list")) < 1:
        raise ValueError(f"gpucomm.{fn}: scatter_object_output_list must have at least one entry")
    if comm.rank == root and (
        scatter_object_input_list is None
        or len(_list(scatter_object_input_list, fn, "scatter_object_input_list")) != comm.world_size
    ):
        got = None if scatter_object_input_list is None else len(scatter_object_input_list)
        raise ValueError(
            f"gpucomm.{fn}: scatter_object_input_list must have world_size = {comm.world_size} entries "
            f"on the source rank, got {got}"
        )
    encoded = [_encode(o, torch.device("cpu")) for o in scatter_object_input_list] if comm.rank == root else []  # type: ignore[union-attr]
    longest = torch.tensor([max((e.numel() for e in encoded), default=0)], dtype=torch.int64)
    comm.broadcast(longest, root)
    width = int(longest.item())
    padded = [torch.zeros(width, dtype=torch.uint8) for _ in encoded]
    for p, e in zip(padded, encoded):
        p[: e.numel()] = e
    sizes = [torch.tensor([e.numel()], dtype=torch.int64) for e in encoded]
    my_size = torch.empty(1, dtype=torch.int64)
    comm.scatter(my_size, sizes or None, root)
    mine = torch.empty(width, dtype=torch.uint8)
    comm.scatter(mine, padded or None, root)
    scatter_object_output_list[0] = _decode(mine, int(my_size.item()))


def send_object_list(
    object_list: list[Any],
    dst: int | None = None,
    group: object = None,
    device: torch.device | None = None,
    group_dst: int | None = None,
    use_batch: bool = False,
) -> None:
    """Send the objects of ``object_list`` to ``dst`` (matched by :func:`recv_object_list`)."""
    fn = "send_object_list"
    comm = lookup.find(group, fn)
    if comm is None:
        return
    peer = lookup.group_rank(comm, dst, group_dst, fn, "dst", default=None)
    where = _device(comm, device, fn)
    encoded = [_encode(o, where) for o in _list(object_list, fn, "object_list")]
    comm.send(torch.tensor([e.numel() for e in encoded], dtype=torch.int64, device=where), peer)  # type: ignore[arg-type]
    comm.send(torch.cat(encoded) if encoded else torch.empty(0, dtype=torch.uint8, device=where), peer)  # type: ignore[arg-type]


def recv_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: object = None,
    device: torch.device | None = None,
    group_src: int | None = None,
    use_batch: bool = False,
) -> int:
    """Fill ``object_list`` (as long as the sender's) with the objects sent; returns the sender's
    global rank (any rank when ``src`` is None)."""
    fn = "recv_object_list"
    comm = lookup.find(group, fn)
    if comm is None:
        return -1
    peer = lookup.group_rank(comm, src, group_src, fn, "src", default=None)
    where = _device(comm, device, fn)
    sizes = torch.empty(len(_list(object_list, fn, "object_list")), dtype=torch.int64, device=where)
    sender = comm.recv(sizes, peer)
    lengths = sizes.tolist()
    data = torch.empty(sum(lengths), dtype=torch.uint8, device=where)
    comm.recv(data, sender)
    for i, piece in enumerate(data.split(lengths)):
        object_list[i] = _decode(piece, lengths[i])
    return comm.global_ranks[sender]
