"""Registers gpucomm's torch.distributed backend when torch is imported, so that
``torch.distributed.init_process_group("gpucomm")`` works in a script that never imports gpucomm.

torch (2.13, the version tested here) calls every entry point of the ``torch.backends`` group at the end of its
own import (``torch._import_device_backends``); pyproject.toml names :func:`register` there.
It runs inside torch's import, after torch.distributed is loaded: it imports nothing of gpucomm
(gpucomm imports torch, Triton's launcher and the rest), and registers a creator that imports
gpucomm the first time torch makes a group of the backend. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``
turns every such entry point off (torch's switch); ``import gpucomm`` then registers it as before.

Its source sits under gpucomm/ (the repository's layout) but it installs as a top-level package,
``_gpucomm_autoload`` (pyproject.toml's package-dir), on purpose: importing any ``gpucomm.*`` module
runs the package's ``__init__``, which would import all of gpucomm into every process that imports torch.
"""

from __future__ import annotations

__all__ = ["register"]

BACKEND_NAME = "gpucomm"  # gpucomm.distributed.backend.BACKEND_NAME


def register() -> None:
    """Register the ``gpucomm`` backend with torch.distributed, unless it is there already or
    torch was built without distributed support."""
    import torch.distributed as dist

    if not dist.is_available() or BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def _create(options: object, backend_options: object = None) -> object:
    """torch's creator: gpucomm's own (gpucomm.distributed.registration), imported on first use."""
    from gpucomm.distributed.registration import _create as create

    return create(options, backend_options)
