"""Algorithm selection: (collective, bytes, world size, topology) → algorithm name.

``GPUCOMM_ALGO`` overrides the table per call family: one name (``ring``) applies to every
family it serves and leaves the table to decide elsewhere (``GPUCOMM_ALGO=ring`` still lets
barrier use flags); ``family=name`` pairs (``all_reduce=ring,broadcast=tree``, a family or
one of its collectives) name one family each, and may follow a bare name that applies to the
rest (``ring,broadcast=tree``). A pair naming an algorithm that does not serve its family, or
no collective at all, is a ``ValueError``.

The choice depends only on values every rank shares (the collective, its size in bytes, the
world size, the topology), so every rank picks the same algorithm; the engine puts the name in
the call's fingerprint anyway.

Deterministic by contract (docs/algorithms.md, "Deterministic reductions"): the table only
ever picks an algorithm that folds every element in rank order in the accumulation type and
rounds once (one-shot, two-shot, direct reduce and reduce-scatter), so the bits of a result do
not depend on the size of the message, the world size's table entry or the algorithm. Ring and
tree fold their partials in ring or heap order and round 16-bit partials at every step: they
run only when GPUCOMM_ALGO names them, with one warning per process that the call leaves the
contract (:data:`ORDER_CHANGING`).

Each threshold names the measurement or the model row behind it. On CUDA IPC (GPUs) the
one-shot / two-shot and the direct / spread thresholds come from the performance model read from
gpucomm's programs
(``python -m gpucomm._bench.model``, docs/performance.md), until a GPU measures it; on the
shared-memory workspace (CPU tensors) from CPU measurements.
"""

from __future__ import annotations

import warnings

__all__ = [
    "ALGORITHMS",
    "FAMILIES",
    "ORDER_CHANGING",
    "SMALL",
    "SMALL_MAX_BYTES",
    "choose",
    "forced_algo",
    "family_of",
    "keeps_contract",
    "oneshot_max_bytes",
]

# The small-message all_reduce (gpucomm.workspace.small): the one-shot's copy, SYNC and fold in one launch
# whose addresses are its parameters. On CUDA tensors it takes one-shot's sizes: it moves the same
# bytes with the same one SYNC and reaches a peer's data after one global load where the program
# kernel waits for three in series (tests/ops/test_small_ptx.py counts them in the sm_90 PTX). Chosen
# by that construction, not by a GPU measurement (none yet); the engine runs the program kernel's
# one-shot where this path cannot serve a call (kernels=torch, more than 8 ranks on a node, a
# message larger than a half).
SMALL = "oneshot_small"
# Where one-shot is the pick on CUDA tensors (oneshot_max_bytes), the small path takes it up to
# 64 KiB: the latency-bound sizes whose first byte waits on the chain of loads the program kernel
# runs; beyond, one-shot is link-bound and the program kernel's channels carry it.
SMALL_MAX_BYTES = 64 << 10

# What serves each call family on the workspace path.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("oneshot", "twoshot", "ring", "tree", "multimem", "oneshot_lang", SMALL),
    "broadcast": ("direct", "spread", "tree"),
    "reduce": ("direct", "spread", "tree"),
    "all_gather": ("direct", "ring"),
    "reduce_scatter": ("direct", "ring"),
    "gather": ("direct",),
    "scatter": ("direct",),
    "all_to_all": ("direct",),
    "p2p": ("direct",),
    "barrier": ("direct",),
}

# Reducing algorithms whose fold is not rank order (ring order, heap order), with 16-bit partials
# rounded at every step: at 4 ranks, 1 Mi fp32 elements of wide dynamic range, another result
# than one-shot's in 6.1% (ring) and 7.5% (tree) of the elements, and ring's result of an element
# changes with the message size (docs/results/2026-11-23-determinism/orders.json). Never picked
# by the table.
# Multimem (NVLink SHARP) folds in the switch, in an order no document gives: outside the
# contract for floating-point SUM until a GPU shows it is rank order (gpucomm.workspace.multimem).
ORDER_CHANGING: dict[str, frozenset[str]] = {
    "all_reduce": frozenset({"ring", "tree", "multimem"}),
    "reduce": frozenset({"tree"}),
    "reduce_scatter": frozenset({"ring"}),
}

# The family of each collective the communicator routes.
FAMILIES: dict[str, str] = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "gather": "gather",
    "scatter": "scatter",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "send": "p2p",
    "isend": "p2p",
    "recv": "p2p",
    "irecv": "p2p",
    "barrier": "barrier",
}

# all_reduce, one-shot vs two-shot, on the shared-memory workspace (the default path of CPU
# tensors on one host): 2-core VM, nothing else running, `gpucomm-bench all_reduce
# --nproc P --algo A --rounds 3|5 -n 10|20` (docs/results/2026-11-22-cpu-2core/, the
# all_reduce_{oneshot,twoshot}*.json files), medians in us, out-of-place / in-place. P=4: one-shot
# ahead at 64 KiB (158/146 vs 174/240), two-shot ahead at 128 KiB (211/200 vs 237/213) and beyond
# (256 KiB: 361/291 vs 463/411; 4 MiB: 3139/2438 vs 4183/4988). P=2: one-shot ahead by 6-17% at
# 16 and 64 KiB, even from 256 KiB on. CPU tensors only: GPUs take the model's thresholds below
# until a GPU run (bench/gpu_check.sh) measures them.
ONESHOT_MAX_BYTES = 64 << 10
# all_reduce, one-shot vs two-shot, on GPUs (CUDA IPC), per world size: the largest size at which
# the model has one-shot ahead, both ends of every link charged (python -m gpucomm._bench.model,
# 0.82 x 450 GB/s, ordinary float32 tensors; docs/results/2026-11-29-model/, "crossover": device us
# one-shot / two-shot at that size and at twice it). One-shot reads (P-1)/P of n more over NVLink
# than two-shot and saves one SYNC per piece, so the crossover falls as P grows.
ONESHOT_MAX_BYTES_GPU: dict[int, int] = {
    # P=2: the same NVLink bytes, half the SYNCs; two-shot copies in only the peer's half (it folds
    # its own from the tensor, and stores its fold there too: no copy out of its own half), so it
    # leads once the pieces' copies outweigh a SYNC: 8 MiB 34.33 / 34.53 us; 16 MiB 62.65 / 60.06 us.
    2: 8 << 20,
    3: 1 << 20,  # P=3: 1 MiB 12.38 / 13.25 us; 2 MiB 18.76 / 17.51 us
    4: 32 << 10,  # P=4: 32 KiB 10.61 / 11.39 us; 64 KiB 15.22 / 13.79 us
    5: 16 << 10,  # P=5: 16 KiB 9.02 / 10.28 us; 32 KiB 12.03 / 11.55 us
    6: 16 << 10,  # P=6: 16 KiB 9.73 / 10.33 us; 32 KiB 13.45 / 11.66 us
    7: 8 << 10,  # P=7: 8 KiB 8.22 / 9.68 us; 16 KiB 10.44 / 10.37 us
    8: 8 << 10,  # P=8: 8 KiB 8.57 / 9.70 us; 16 KiB 11.15 / 10.40 us (the model's 8-rank rows)
}
# Above 8 ranks (no model row): 8 ranks' value, the lowest; the crossover falls as P grows to 8.
ONESHOT_MAX_BYTES_GPU_MANY = ONESHOT_MAX_BYTES_GPU[8]
# What the deterministic choice costs against the fastest of all four algorithms, size by size
# at 4 ranks on this path: docs/algorithms.md, "What the contract costs" (a 2-core VM under
# heavy load from other work: 1.1-3.6x behind tree or ring at most sizes with
# OMP_NUM_THREADS=1; the α-β model of an NVSwitch GPU node has it the fastest at every size).
# Every number from here on is older: the host-driven emulation (shm transport, torch kernels,
# waits that slept 1 ms) on a 2-core VM shared with other jobs, `gpucomm-bench <collective>
# --nproc P --transport shm --kernels torch --algo A -n 10 -w 3 --device cpu`, median time in ms;
# full tables in docs/algorithms.md ("Measurements"). Ranks outnumbered cores there, which
# flatters neighbour-only schedules (ring, tree). To be measured again on the stream-ordered path.
#
# all_reduce, two-shot vs ring: at 16 MiB ring was ahead at P=8 (802 vs 1831 ms) and P=4
# (110/159 vs 273/296 ms); at 1 MiB it was behind at P=8 (443 vs 171 ms). Tree was the fastest
# of all from 1 MiB at P=4 and P=8 in this emulation (P=8, 16 MiB: 508 ms). The table picks
# neither ring nor tree, since neither folds in rank order (ORDER_CHANGING), whatever they gain
# in time.
# broadcast and reduce: direct (one step) vs tree (log2 P steps). Broadcast: direct was ahead
# at every size from 4 KiB to 16 MiB at P=4 and P=8 (P=8, 16 MiB: 214 vs 237 ms). Reduce, P=8:
# mixed (4 KiB: 2.7 vs 3.2 ms direct ahead; 64 KiB: 28 vs 15 ms and 16 MiB: 333 vs 259 ms,
# tree ahead; 1 MiB: 43 vs 54 ms, direct ahead), within the noise: direct, the one that needs
# no partial results. The table picks direct; tree is GPUCOMM_ALGO=tree.
#
# all_gather and reduce_scatter: direct vs ring. All-gather: direct was ahead at every size
# (P=8, 1 MiB gathered: 133 vs 373 ms). Reduce-scatter: direct ahead at 16 KiB (P=4, 8), mixed
# above (P=8, 256 KiB: 43 vs 17 ms ring ahead; 4 MiB: 350 vs 341 ms). The table picks direct.

# broadcast and reduce on GPUs: direct (every byte through the root's one link, one SYNC a piece)
# up to these sizes, spread above (gpucomm.algorithms.spread: every GPU's links carry about one
# piece; one SYNC more for a one-piece broadcast, two for a reduce). From the model with both ends
# of each link charged (python -m gpucomm._bench.model, 8 ranks, 0.82 x 450 GB/s; its "rooted"
# rows, docs/performance.md), device us direct / spread:
ROOTED_DIRECT_MAX_BYTES_GPU: dict[str, int] = {
    # broadcast: 256 KiB 11.67 / 12.95; 512 KiB 16.64 / 13.66 (and at 0.57 x 450: 13.85 / 14.33,
    # 21.01 / 15.35: the same crossover).
    "broadcast": 256 << 10,
    # reduce: 8 KiB 8.57 / 9.72; 16 KiB 11.15 / 10.44 (0.57 x 450: 8 KiB 9.66 / 9.99, 16 KiB
    # 13.33 / 10.99).
    "reduce": 8 << 10,
}


def oneshot_max_bytes(world_size: int, topology: str) -> int:
    """The largest all_reduce that ``auto`` runs one-shot on ``topology`` (the thresholds above)."""
    if topology == "cuda_ipc":
        return ONESHOT_MAX_BYTES_GPU.get(world_size, ONESHOT_MAX_BYTES_GPU_MANY if world_size > 8 else 1 << 30)
    return ONESHOT_MAX_BYTES


def family_of(fn: str) -> str | None:
    return FAMILIES.get(fn)


def keeps_contract(family: str, algo: str) -> bool:
    """Whether ``algo`` folds every element of a ``family`` call in rank order, rounding once."""
    return algo not in ORDER_CHANGING.get(family, ())


def _warn_order_changing(family: str, algo: str, knob: str) -> None:
    # Once per (family, algorithm) and process: Python's warning registry shows a message once
    # per place it is raised from, and the text names no size. A warning rather than a line on
    # gpucomm's logger: the logger carries one line per served call (GPUCOMM_DEBUG=INFO), and
    # an application can filter this one, or make it an error, with Python's warning filters.
    warnings.warn(
        f"gpucomm.{family}: GPUCOMM_ALGO={knob} forces {algo}, which folds partial results in {algo} order, "
        f"not rank order: results now depend on the message size and differ from the default's; "
        f"unset GPUCOMM_ALGO (or name {_CONTRACT_KEEPERS[family]}) to keep reductions deterministic",
        UserWarning,
        stacklevel=2,
    )


# What to name instead, per family with order-changing algorithms.
_CONTRACT_KEEPERS = {
    "all_reduce": "oneshot or twoshot",
    "reduce": "direct",
    "reduce_scatter": "direct",
}


def _forced(family: str, served: tuple[str, ...], knob: str) -> str:
    """The algorithm GPUCOMM_ALGO names for ``family``, or "auto"; ValueError as :func:`forced_algo`."""
    default, pairs = "auto", {}
    for item in knob.split(","):
        name, eq, algo = item.partition("=")
        if not eq:
            default = name.strip()
            continue
        name = name.strip()
        key = FAMILIES.get(name, name)  # all_gather_into_tensor=ring names the all_gather family
        if key not in ALGORITHMS:
            raise ValueError(
                f"gpucomm: GPUCOMM_ALGO={knob} names {name!r}, which is not a collective; use one of {list(ALGORITHMS)}"
            )
        pairs[key] = algo.strip()
    forced = pairs.get(family)
    if forced is None:
        return default if default in served else "auto"
    if forced != "auto" and forced not in served:
        raise ValueError(
            f"gpucomm.{family}: GPUCOMM_ALGO={knob} names {forced}, which does not serve {family}; "
            f"choose one of {list(served)}"
        )
    return forced


def forced_algo(fn: str, knob: str) -> str:
    """The algorithm GPUCOMM_ALGO (``knob``) names for ``fn``'s family, or "auto".

    Raises ValueError where ``knob`` names no collective, or an algorithm that does not serve the
    family.
    """
    family = family_of(fn)
    return "auto" if family is None else _forced(family, ALGORITHMS[family], knob)


def choose(fn: str, nbytes: int, world_size: int, topology: str, knob: str) -> str | None:
    """The algorithm for one call, or None when the workspace path does not serve it.

    ``topology`` is the transport (``shm``, ``cuda_ipc``) or ``hierarchical`` when the ranks
    span nodes; ``knob`` is GPUCOMM_ALGO. Raises ValueError as :func:`forced_algo`; warns once
    where ``knob`` forces an algorithm outside the determinism contract (:data:`ORDER_CHANGING`).

    Example::

        >>> choose("all_reduce", 4096, 4, "cuda_ipc", "auto")
        'oneshot_small'
        >>> choose("all_gather_into_tensor", 4096, 4, "cuda_ipc", "all_gather=ring")
        'ring'
    """
    family = family_of(fn)
    if family is None:
        return None
    if topology == "hierarchical":
        # Ranks on several nodes: every collective is composed of the node's flat ones and an
        # inter-node group's (gpucomm.algorithms.hierarchical, gpucomm.algorithms.across_nodes;
        # GPUCOMM_ALGO applies to the node's stages). Send and recv go through gloo.
        return "hierarchical" if family != "p2p" else None
    served = ALGORITHMS[family]
    forced = _forced(family, served, knob)
    if forced != "auto":
        if not keeps_contract(family, forced):
            _warn_order_changing(family, forced, knob)
        return forced
    if family == "all_reduce":
        if nbytes > oneshot_max_bytes(world_size, topology):
            return "twoshot"
        return SMALL if topology == "cuda_ipc" and nbytes <= SMALL_MAX_BYTES else "oneshot"
    if topology == "cuda_ipc" and nbytes > ROOTED_DIRECT_MAX_BYTES_GPU.get(family, 1 << 62):
        return "spread"
    return "direct"
