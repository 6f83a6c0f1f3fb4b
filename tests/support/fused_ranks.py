"""One rank's comparison of gpucomm.fused against the unfused calls it stands for: run by
tests/fused/test_fused.py on the shm workspace and by tests/gpu/test_fused_gpu.py on CUDA tensors.

- all_reduce_residual_rmsnorm equals gpucomm.all_reduce followed by residual_rmsnorm bit for bit,
  and a float64 reference within the dtype's rounding;
- all_gather_matmul equals all_gather_into_tensor followed by torch.matmul within the matmul's
  tolerance.
"""

from __future__ import annotations

__all__ = ["WORKSPACE", "fused_against_unfused"]

# 16 KiB of data area: 3 KiB stage halves, so that 5 rows of 200 fp32 take two pieces (9 rows,
# three), and all_gather_matmul's shards of 40 x 24 take a heap buffer.
WORKSPACE = "16K"
_TOL = {"torch.float32": 1e-5, "torch.float16": 2e-3, "torch.bfloat16": 1.6e-2}


def fused_against_unfused(
    rank: int,
    world_size: int,
    seed: int,
    device: str = "cpu",
    dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32"),
) -> list[str]:
    """One rank's comparisons of the fused ops against the unfused calls, on ``device`` ("cpu": the
    shm workspace; "cuda": cuda_ipc) for each of ``dtypes``: the problems found (empty: none)."""
    import torch

    import gpucomm
    import gpucomm.fused as gf

    transport = "shm" if device == "cpu" else "cuda_ipc"
    gpucomm.init_process_group(transport=transport, kernels="triton", workspace_bytes=WORKSPACE, timeout=60, channels=2)
    dev = torch.device("cpu") if device == "cpu" else torch.device("cuda", torch.cuda.current_device())
    problems = []
    case = 0
    for dtype in [getattr(torch, name) for name in dtypes]:
        for rows, hidden, algo in ((1, 24, "auto"), (5, 200, "oneshot"), (9, 200, "twoshot")):
            case += 1
            g = torch.Generator().manual_seed(seed * 1000 + case)
            xs = [torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(world_size)]
            residual = torch.randn(rows, hidden, generator=g).to(dtype)
            weight = (1 + torch.randn(hidden, generator=g) / 4).to(dtype)
            x = xs[rank].clone().to(dev)
            residual, weight = residual.to(dev), weight.to(dev)
            out, new_residual = gf.all_reduce_residual_rmsnorm(x, residual, weight, 1e-5, algo=algo)
            where = f"{dtype} {rows}x{hidden} {algo}"
            if not torch.equal(x.cpu(), xs[rank]):
                problems.append(f"{where}: x changed")
            s = x.clone()
            gpucomm.all_reduce(s)
            out2, new_residual2 = gf.residual_rmsnorm(s, residual, weight, 1e-5)
            if not (
                torch.equal(out.view(torch.uint8), out2.view(torch.uint8)) and torch.equal(new_residual, new_residual2)
            ):
                problems.append(
                    f"{where}: fused differs from all_reduce + residual_rmsnorm in {int((out != out2).sum())} elements"
                )
            h = sum(t.double() for t in xs) + residual.cpu().double()
            ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.cpu().double()
            tol = _TOL[str(dtype)] * 4  # s, h and out each rounded once to the dtype
            if not torch.allclose(out.cpu().double(), ref, rtol=tol, atol=tol):
                problems.append(
                    f"{where}: off the float64 reference by {float((out.cpu().double() - ref).abs().max()):.3g}"
                )
        for m, k, n in ((3, 20, 9), (40, 24, 17)):  # the second: a shard larger than a stage half
            case += 1
            g = torch.Generator().manual_seed(seed * 1000 + case)
            shards = [torch.randn(m, k, generator=g).to(dtype).to(dev) for _ in range(world_size)]
            b = (torch.randn(k, n, generator=g).to(dtype) + rank).to(dev)  # each rank's own b
            c = gf.all_gather_matmul(shards[rank], b)
            gathered = torch.empty(world_size * m, k, dtype=dtype, device=dev)
            gpucomm.all_gather_into_tensor(gathered, shards[rank])
            unfused = (gathered.float() @ b.float()).to(dtype)
            tol = _TOL[str(dtype)] * 2
            if c.shape != (world_size * m, n) or not torch.allclose(
                c.float(), unfused.float(), rtol=tol, atol=tol * k**0.5
            ):
                off = float((c.float() - unfused.float()).abs().max())
                problems.append(f"all_gather_matmul {dtype} {m}x{k}x{n}: off the unfused result by {off:.3g}")
    gpucomm.destroy_process_group()
    return problems
