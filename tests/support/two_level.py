"""The two-level order of reductions across nodes, and a check of gpucomm's results against it.

Each node's ranks fold in rank order in the accumulation type, then the nodes in node order
(gpucomm/algorithms/hierarchical.py, gpucomm/algorithms/across_nodes.py).
"""

from __future__ import annotations


def wide(seed: int, case: int, rank: int, n: int, dtype):
    """Values of random sign and exponent: a fold in another order changes their bits."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + case * 1009 + rank)
    sign = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64) * 2 - 1
    exponent = torch.randint(-12, 11, (n,), generator=gen).to(torch.float64)
    return (sign * (1 + torch.rand(n, generator=gen, dtype=torch.float64)) * torch.exp2(exponent)).to(dtype)


def two_level(inputs: list, op: str, nodes: list[list[int]]):
    """The documented order: each node's ranks folded in rank order in the accumulation type
    (fp32 for 16-bit floats), then the nodes in node order; AVG divides once by the world size;
    one rounding to the dtype."""
    import torch

    dtype = inputs[0].dtype
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def fold(xs: list):
        total = xs[0].to(acc)
        for x in xs[1:]:
            total = total + x.to(acc)
        return total

    total = fold([fold([inputs[r] for r in node]) for node in nodes])
    if op == "AVG":
        total = total / len(inputs)
    return total.to(dtype)


def two_level_checks(rank: int, world_size: int, seed: int, nodes: list[list[int]]) -> list[str]:
    """all_reduce, reduce, reduce_scatter(_tensor) of wide floats, bit for bit the two-level order."""
    import torch

    import gpucomm as dist

    failures, case, n = [], 0, 37
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for op in ("SUM", "AVG"):
            case += 1
            xs = [wide(seed, case, r, n * world_size, dtype) for r in range(world_size)]
            rop = getattr(dist.ReduceOp, op)
            out = torch.full((n,), float("nan"), dtype=dtype)
            dist.reduce_scatter_tensor(out, xs[rank].clone(), op=rop)
            got = {"reduce_scatter_tensor": out}
            pieces = [t.clone() for t in xs[rank].split(n)]
            out2 = torch.full((n,), float("nan"), dtype=dtype)
            dist.reduce_scatter(out2, pieces, op=rop)
            got["reduce_scatter"] = out2
            mine = [x[rank * n : (rank + 1) * n] for x in xs]
            expected = {name: two_level(mine, op, nodes) for name in got}
            t = xs[rank][:n].clone()
            dist.all_reduce(t, op=rop)
            got["all_reduce"], expected["all_reduce"] = t, two_level([x[:n] for x in xs], op, nodes)
            dst = case % world_size
            t = xs[rank][:n].clone()
            dist.reduce(t, dst=dst, op=rop)
            if rank == dst:
                got["reduce"], expected["reduce"] = t, expected["all_reduce"]
            for name, value in got.items():
                if not torch.equal(value.view(torch.uint8), expected[name].view(torch.uint8)):
                    failures.append(f"rank {rank}: {name} {dtype} {op} is not the two-level order's result")
    return failures
