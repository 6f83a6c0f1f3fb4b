"""Signatures compared with the installed torch's: gpucomm follows torch 2.13's, and an older
torch (2.11, on the lent GPU image) lacks a few parameters and names that gpucomm offers anyway."""

from __future__ import annotations

import inspect

import torch.distributed as tdist

# Parameters torch 2.13 has and torch 2.11 lacks, by function: left out of gpucomm's side where
# the installed torch's function lacks them.
NEWER_PARAMETERS = {"barrier": {"timeout"}, "new_group": {"sort_ranks"}, "split_group": {"backend"}}


def shape(fn: object) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter a caller can pass, torch's private ones and
    gpucomm's **knobs aside; ReduceOp defaults compare by name."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name.startswith("_") or p.kind is p.VAR_KEYWORD or p.name == "self":
            continue
        out.append((p.name, p.kind, getattr(p.default, "name", p.default)))
    return out


def shapes(name: str, ours: object, theirs: object) -> tuple[list, list]:
    """gpucomm's and torch's shapes of ``name``, gpucomm's without the newer torch's parameters
    the installed torch lacks."""
    mine, torchs = shape(ours), shape(theirs)
    have = {p[0] for p in torchs}
    newer = NEWER_PARAMETERS.get(name, set()) - have
    return [p for p in mine if p[0] not in newer], torchs


def torch_has(name: str) -> bool:
    """Whether this torch's torch.distributed has ``name``."""
    return hasattr(tdist, name)
