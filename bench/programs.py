"""Every rank's program of one collective, built as the engine builds it, without running it.

The performance model (bench/model.py) and the link-balance test (tests/algorithms/
test_link_balance.py) read these: the real Builder and algorithms on CPU tensors that are never
touched (``torch.empty``: nothing is launched, no memory is used), the algorithm ``auto`` picks on
GPUs (gpucomm.algorithms.select with the ``cuda_ipc`` topology) unless one is named, and on a
symmetric tensor the engine's in-place rule (gpucomm.workspace.collectives: in place above one
half). Sizes are float32 and in bytes: the tensor of all_reduce, broadcast and reduce; the output
of all_gather and gather; the input of reduce_scatter and scatter; what each rank sends in
all_to_all (1/P to each rank).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gpucomm.algorithms import allgather, allreduce, alltoall, reducescatter, rooted, select, symmetric
from gpucomm.ops.contract import Region
from gpucomm.ops.program import Builder, Program
from gpucomm.reduce_op import ReduceOp

__all__ = ["COLLECTIVES", "pick", "heap_bases", "build"]

# What the balance test and the model build; all_to_all is its second program (deliver), the one
# that moves the data.
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
_FN = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
_ROOT = 0


def pick(collective: str, nbytes: int, world: int) -> str:
    """The algorithm ``auto`` runs on GPUs."""
    return select.choose(_FN.get(collective, collective), nbytes, world, "cuda_ipc", "auto")


def heap_bases(tensor: torch.Tensor, rank: int, world: int) -> list[int]:
    """Every rank's heap base as rank ``rank`` sees it, its own at ``tensor``.

    The peers' are at addresses nothing else uses: nothing is launched, they only tell its operands
    from theirs.
    """
    span = -(-tensor.numel() * tensor.element_size() // (1 << 30)) * (4 << 30)
    return [tensor.data_ptr() + (p - rank) * span for p in range(world)]


def _in_place(collective: str, algo: str, nbytes: int, half_bytes: int) -> bool:
    """The engine's rule (WorkspaceCollectives._all_reduce_plan and _in_place)."""
    if collective == "all_reduce":
        return algo == "twoshot" and nbytes > half_bytes
    return (
        collective in ("broadcast", "reduce", "all_gather", "reduce_scatter")
        and algo == "direct"
        and nbytes > half_bytes
    )


def build(
    collective: str,
    nbytes: int,
    world: int,
    rank: int,
    half_bytes: int,
    algo: str | None = None,
    symmetric_tensor: bool = False,
    force_in_place: bool = False,
) -> tuple[Program, list[int] | None]:
    """Rank ``rank``'s program of ``collective`` moving ``nbytes`` (module docstring), and the heap
    bases it was built with where it runs in place on a symmetric tensor (else None).

    ``force_in_place``: in place at any size, as a forced two-shot (GPUCOMM_ALGO) runs.
    """
    P, me = world, rank
    algo = algo or pick(collective, nbytes, world)
    if algo == select.SMALL:
        algo = "oneshot"  # the small path moves one-shot's bytes (gpucomm.workspace.small)
    n = max(1, nbytes // 4)
    share = max(1, n // P)
    inplace = symmetric_tensor and (force_in_place or _in_place(collective, algo, nbytes, half_bytes))
    if collective in ("all_gather", "gather"):
        tensor, outs = torch.empty(share), [torch.empty(share) for _ in range(P)]
        whole = torch.empty(share * P)
    elif collective in ("reduce_scatter", "scatter"):
        tensor, whole = torch.empty(share), torch.empty(share * P)
    else:
        tensor = torch.empty(n)
    source = tensor if collective != "reduce_scatter" else whole
    heap = heap_bases(source, me, P) if inplace else None
    args = [Region.of(tensor)] + ([Region.of(whole)] if collective in ("all_gather", "reduce_scatter") else [])
    b = Builder(me, P, half_bytes, collective, (algo, nbytes), root=_ROOT, args=args, heap=heap)
    if collective == "all_reduce":
        if inplace:
            allreduce.twoshot_symmetric(b, tensor, ReduceOp.SUM)
        else:
            allreduce.run(algo, b, tensor, ReduceOp.SUM)
    elif collective == "broadcast":
        (symmetric.broadcast(b, tensor, _ROOT) if inplace else rooted.broadcast(algo, b, tensor, _ROOT))
    elif collective == "reduce":
        if inplace:
            symmetric.reduce(b, tensor, _ROOT, ReduceOp.SUM)
        else:
            rooted.reduce(algo, b, tensor, _ROOT, ReduceOp.SUM)
    elif collective == "all_gather":
        size = share * 4
        parts = [Region.of(whole).sub(p * size, size) for p in range(P)]
        if inplace:
            symmetric.all_gather_into_tensor(b, Region.of(whole), tensor)
        else:
            allgather.run(algo, b, Region.of(tensor), parts)
    elif collective == "reduce_scatter":
        size = share * 4
        chunks = [Region.of(whole).sub(p * size, size) for p in range(P)]
        if inplace:
            symmetric.reduce_scatter_tensor(b, Region.of(tensor), Region.of(whole), torch.float32, ReduceOp.SUM)
        else:
            reducescatter.run(algo, b, chunks, Region.of(tensor), torch.float32, ReduceOp.SUM, source=Region.of(whole))
    elif collective == "all_to_all":
        ins, outs_ = _split(tensor, P), _split(torch.empty(n), P)
        matrix = [[r.nbytes for r in ins] + [r.nbytes for r in outs_] for _ in range(P)]
        total = alltoall.rounds(matrix, half_bytes, list(range(P)), "all_to_all")
        alltoall.deliver(b, outs_, ins, total)
    elif collective == "gather":
        rooted.gather(b, tensor, outs if me == _ROOT else None, _ROOT)
    elif collective == "scatter":
        ins = [torch.empty(share) for _ in range(P)] if me == _ROOT else None
        rooted.scatter(b, tensor, ins, _ROOT)
    else:
        raise ValueError(f"programs.build: collective must be one of {list(COLLECTIVES)}, got {collective!r}")
    return b.finish(), heap


def _split(tensor: torch.Tensor, P: int) -> Sequence[Region]:
    whole, size = Region.of(tensor), tensor.numel() // P * tensor.element_size()
    return [whole.sub(p * size, size) for p in range(P)]
