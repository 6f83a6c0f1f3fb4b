"""torch.distributed's arguments in gpucomm's terms: a backend string, a ``device_id``, a
timeout and ``pg_options``, each checked and turned into what gpucomm's Communicator takes.

Each function raises ``TypeError`` or ``ValueError`` naming the public call ``fn`` the user made.
"""

from __future__ import annotations

import torch

from gpucomm.config import check_timeout
from gpucomm.distributed.backend import Options

__all__ = ["device_for", "knobs_of", "options_for", "seconds_of", "transport_for"]

# torch.distributed's backend names, and what gpucomm serves each with: None = gpucomm's own
# paths (the workspace for CUDA tensors, gloo or GPUCOMM_TRANSPORT for CPU ones), "gloo" = every
# tensor of that device through gloo.
_DEVICE_BACKENDS = {"gpucomm": None, "nccl": None, "gloo": "gloo"}
_DEVICES = ("cpu", "cuda")


def transport_for(backend: str | None, fn: str) -> str | None:
    """The transport knob torch's ``backend`` string asks for (None: gpucomm's default paths).

    Accepts None, "gpucomm", "nccl", "gloo" and device maps such as "cuda:nccl,cpu:gloo".
    """
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(f"gpucomm.{fn}: backend must be a str or None, got {type(backend).__name__}")
    text = backend.strip().lower()
    pairs = [item.split(":", 1) for item in text.split(",")] if ":" in text else [[d, text] for d in _DEVICES]
    served: dict[str, str | None] = {}
    for pair in pairs:
        if len(pair) != 2 or pair[0].strip() not in _DEVICES:
            raise ValueError(
                f"gpucomm.{fn}: backend {backend!r}: device maps look like 'cuda:nccl,cpu:gloo' "
                f"with devices {list(_DEVICES)}"
            )
        device, name = pair[0].strip(), pair[1].strip()
        if name not in _DEVICE_BACKENDS:
            raise ValueError(
                f"gpucomm.{fn}: backend {name!r} is not one gpucomm serves; use None or 'gpucomm' (gpucomm's own "
                f"paths), 'nccl' (the same: gpucomm replaces NCCL), or 'gloo' (every call through gloo)"
            )
        served[device] = _DEVICE_BACKENDS[name]
    if served.get("cuda") == "gloo":
        # One transport serves every device of a communicator: CUDA tensors on gloo means
        # CPU tensors on gloo too, which is what gpucomm does for them by default.
        return "gloo"
    if "cuda" not in served and served.get("cpu") == "gloo":
        return "gloo"
    return None


def device_for(device_id: object, fn: str) -> torch.device | None:
    """The CUDA device ``device_id`` (a ``torch.device`` or an index) names on this host, or None."""
    if device_id is None:
        return None
    device = (
        torch.device("cuda", device_id) if isinstance(device_id, int) and not isinstance(device_id, bool) else device_id
    )
    if not isinstance(device, torch.device):
        raise TypeError(f"gpucomm.{fn}: device_id must be a torch.device or an int, got {type(device_id).__name__}")
    if device.type != "cuda" or device.index is None:
        raise ValueError(
            f"gpucomm.{fn}: device_id must be a CUDA device with an index such as cuda:0, got {device}; "
            "CPU tensors need no device_id"
        )
    if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"gpucomm.{fn}: device_id {device} does not exist on this host ({count} CUDA devices)")
    return device


def seconds_of(timeout: object, fn: str) -> float | None:
    """``timeout`` (a timedelta or a number of seconds) in seconds; None stays None.

    Raises ValueError naming ``fn`` and the value for one out of range (:func:`gpucomm.config.check_timeout`)."""
    return None if timeout is None else check_timeout(timeout, fn)


def knobs_of(pg_options: object, fn: str) -> dict[str, object]:
    """The knobs ``pg_options`` sets (a :class:`gpucomm.distributed.backend.Options`, or None: none)."""
    if pg_options is None:
        return {}
    if not isinstance(pg_options, Options):
        raise TypeError(
            f"gpucomm.{fn}: pg_options must be a gpucomm.distributed.backend.Options (gpucomm's knobs), got "
            f"{type(pg_options).__name__}; a torch backend's options (e.g. NCCL's) do not apply to gpucomm"
        )
    return pg_options.knobs()


def options_for(backend: str | None, pg_options: object, fn: str) -> Options | None:
    """The gpucomm backend's options for a group that a torch backend string and gpucomm's
    ``pg_options`` ask for (None: the default group's knobs)."""
    knobs = knobs_of(pg_options, fn)
    transport = transport_for(backend, fn)
    if transport is not None:
        knobs["transport"] = transport
    return Options(**knobs) if knobs else None  # type: ignore[arg-type]
