"""Calls whose buffers overlap, and the result each must give: the one separate buffers give.

A case lays every buffer of one call out in one flat tensor ``buf`` as ``(offset, numel)``
spans; :func:`run_case` makes the call on views of ``buf`` and :func:`separate_result` makes it
on fresh buffers (the inputs copied out of ``buf``, the outputs empty) and then copies the
outputs into a copy of ``buf`` in list order. The two must be equal on every rank: that is the
rule of docs/reliability.md, "Overlapping buffers". Used by tests/comm/test_overlap.py and
tests/comm/test_bad_input_fuzz.py, inside spawned ranks.
"""

from __future__ import annotations

import torch

Span = tuple[int, int]  # (offset, numel) into the case's flat buffer

# Collectives that take an output and an input: how each is called on (outputs, inputs, root).
TWO_BUFFER = (
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
)


def call(comm: object, fn: str, outs: list[torch.Tensor], ins: list[torch.Tensor], root: int) -> None:
    """Make ``fn`` on ``comm`` (a Communicator) with the spans' tensors; ``root`` for gather and scatter."""
    if fn == "all_gather_into_tensor":
        comm.all_gather_into_tensor(outs[0], ins[0])
    elif fn == "all_gather":
        comm.all_gather(outs, ins[0])
    elif fn == "reduce_scatter_tensor":
        comm.reduce_scatter_tensor(outs[0], ins[0])
    elif fn == "reduce_scatter":
        comm.reduce_scatter(outs[0], ins)
    elif fn == "all_to_all_single":
        comm.all_to_all_single(outs[0], ins[0])
    elif fn == "all_to_all":
        comm.all_to_all(outs, ins)
    elif fn == "gather":
        comm.gather(ins[0], outs or None, dst=root)
    elif fn == "scatter":
        comm.scatter(outs[0], ins or None, src=root)
    else:
        raise ValueError(f"overlap_cases.call: no collective {fn!r}")


def fill(rank: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Values that tell every element and rank apart, and that sums over 4 ranks keep exact."""
    return (torch.arange(size, dtype=torch.int64) % 61 + 100 * (rank + 1)).to(dtype)


def views(buf: torch.Tensor, spans: list[Span]) -> list[torch.Tensor]:
    """The views of ``buf`` that ``spans`` (offset, length) name."""
    return [buf[o : o + k] for o, k in spans]


def run_case(comm: object, fn: str, buf: torch.Tensor, outs: list[Span], ins: list[Span], root: int) -> torch.Tensor:
    """The call on overlapping views of ``buf`` (changed in place, and returned)."""
    call(comm, fn, views(buf, outs), views(buf, ins), root)
    return buf


def separate_result(
    comm: object, fn: str, buf: torch.Tensor, outs: list[Span], ins: list[Span], root: int
) -> torch.Tensor:
    """What ``buf`` holds after the call made on separate buffers, outputs copied back in list order."""
    own_outs = [v.clone() for v in views(buf, outs)]
    call(comm, fn, own_outs, [v.clone() for v in views(buf, ins)], root)
    result = buf.clone()
    for (o, k), t in zip(outs, own_outs, strict=True):
        result[o : o + k] = t
    return result


def cases(rank: int, world_size: int, n: int) -> list[tuple[str, str, list[Span], list[Span], int]]:
    """``(label, fn, output spans, input spans, root)`` for every overlap a two-buffer call can
    have at this world size, torch's in-place forms among them (labelled "in place"). Pieces have
    ``n`` elements (even); the spans fit in ``(2 * world_size + 2) * n`` elements."""
    w, h, r = world_size, n // 2, rank
    root = w - 1
    pieces = [(i * n, n) for i in range(w)]
    shifted = [(i * n + h, n) for i in range(w)]
    found = [
        ("input straddles two chunks", "all_gather_into_tensor", [(0, w * n)], [(h, n)], root),
        ("input over the output's end", "all_gather_into_tensor", [(0, w * n)], [(w * n - h, n)], root),
        ("in place", "all_gather_into_tensor", [(0, w * n)], [(r * n, n)], root),
        ("input straddles two entries", "all_gather", pieces, [(h, n)], root),
        ("one output listed each time", "all_gather", [(0, n)] * w, [(w * n, n)], root),
        ("outputs overlap by half", "all_gather", [(i * h, n) for i in range(w)], [(w * n + n, n)], root),
        ("in place", "all_gather", pieces, [(r * n, n)], root),
        ("output straddles two chunks", "reduce_scatter_tensor", [(h, n)], [(0, w * n)], root),
        ("output over the input's end", "reduce_scatter_tensor", [(w * n - h, n)], [(0, w * n)], root),
        ("in place", "reduce_scatter_tensor", [(r * n, n)], [(0, w * n)], root),
        ("output straddles two entries", "reduce_scatter", [(h, n)], pieces, root),
        ("in place", "reduce_scatter", [(r * n, n)], pieces, root),
        ("output shifted half a piece", "all_to_all_single", [(h, w * n)], [(0, w * n)], root),
        ("one tensor for both", "all_to_all_single", [(0, w * n)], [(0, w * n)], root),
        ("outputs shifted half a piece", "all_to_all", shifted, pieces, root),
        ("one tensor per pair", "all_to_all", pieces, pieces, root),
        ("outputs overlap each other", "all_to_all", [(0, n)] * w, [(w * n + i * n, n) for i in range(w)], root),
        ("in place", "all_to_all", [(w * n + i * n, n) if i != r else (r * n, n) for i in range(w)], pieces, root),
    ]
    for dst in sorted({0, root}):
        mine = r == dst
        found += [
            (f"input straddles two entries, root {dst}", "gather", pieces if mine else [], [(h, n)], dst),
            (f"one output listed each time, root {dst}", "gather", [(0, n)] * w if mine else [], [(h, n)], dst),
            (f"in place, root {dst}", "gather", pieces if mine else [], [(dst * n, n)], dst),
            (f"output straddles two entries, root {dst}", "scatter", [(h, n)], pieces if mine else [], dst),
            (f"in place, root {dst}", "scatter", [(dst * n, n)], pieces if mine else [], dst),
        ]
    return found
