"""Algorithm selection: (collective, bytes, world size, topology) → algorithm name.

``GPUCOMM_ALGO`` (one name, or ``family=name`` pairs) overrides the table per call family.
Each threshold names the measurement behind it.
"""

from __future__ import annotations

__all__ = ["ALGORITHMS", "choose"]

# What serves each collective on the workspace path, the first entry being the default.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("oneshot", "twoshot"),
    "barrier": ("direct",),
}

# all_reduce: one-shot (every rank reads all P slots: (P-1)·n bytes in per rank, one barrier)
# wins while latency dominates; two-shot ((P-1)/P·2n bytes per rank, two barriers) wins once
# bandwidth does. CPU emulation (shm + torch kernels, 4 ranks, 2-core CI machine, 2026-11-21,
# `gpucomm-bench all_reduce --nproc 4 --algo oneshot|twoshot`): see docs/algorithms.md; to be
# replaced by GPU numbers when a GPU is lent.
ONESHOT_MAX_BYTES = 256 << 10


def choose(family: str, nbytes: int, world_size: int, knob: str) -> str | None:
    """The algorithm for one call, or None when the workspace path does not serve it.

    ``knob`` is GPUCOMM_ALGO. A name given for this family (``all_reduce=ring``) must serve it,
    else ``ValueError``; a single name for every family applies where it serves and leaves the
    table to decide elsewhere (``GPUCOMM_ALGO=ring`` still lets barrier use flags).
    """
    served = ALGORITHMS.get(family)
    if served is None:
        return None
    forced = knob
    if "=" in knob:
        pairs = dict(item.split("=", 1) for item in knob.split(","))
        forced = pairs.get(family, "auto")
        if forced != "auto" and forced not in served:
            raise ValueError(f"gpucomm.{family}: GPUCOMM_ALGO={knob} names {forced}, which does not serve {family}; choose one of {list(served)}")
    if forced in served:
        return forced
    if family == "all_reduce":
        return "oneshot" if nbytes <= ONESHOT_MAX_BYTES or world_size <= 2 else "twoshot"
    return served[0]
