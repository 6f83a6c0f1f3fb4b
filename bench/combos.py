"""The element types and reductions a run measures: one of each, or every one (``-d all``, ``-o all``).

As nccl-tests does with ``-d all -o all``: every reducing collective runs each dtype with each op;
a collective that does not reduce runs each dtype once (the op does not change what it moves).
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "OPS", "combos"]

DTYPES = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "double": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
}
OPS = ("sum", "prod", "min", "max", "avg")


def combos(dtype: str, op: str, reducing: bool) -> list[tuple[str, str]]:
    """``[(dtype, op), ...]`` in the order they run; ``"all"`` for either expands it."""
    if dtype != "all" and dtype not in DTYPES:
        raise ValueError(f"combos: expected -d from {[*DTYPES, 'all']}, got {dtype!r}")
    if op != "all" and op not in OPS:
        raise ValueError(f"combos: expected -o from {[*OPS, 'all']}, got {op!r}")
    dtypes = list(DTYPES) if dtype == "all" else [dtype]
    ops = list(OPS) if op == "all" else [op]
    if not reducing:
        ops = ops[:1]
    return [(d, o) for d in dtypes for o in ops]
